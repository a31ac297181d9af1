"""Owns the model and its KV cache; builds every tensor of a step in one place (`prepare`).

A step's tensors come from the persistent input rows (worker/input_batch.py); decode-only steps
run through the static, bucket-padded buffers of worker/cuda_graph.py (captured as CUDA graphs on
CUDA) unless `enforce_eager`; other steps run the model eagerly on the step's own shapes.
"""
from __future__ import annotations

import logging
import os

import torch

import kernels
from common.config import EngineConfig, hf_overrides
from common.kv_capacity import available_blocks, tokens_that_fit
from common.models import resolve_model
from common.pooling import pooler_config
from common.plan_state import ScheduledSequence, TableChanges
from kernels.kv_quant import kv_cache_dtype
from worker.context import attention_context
from worker.cuda_graph import DecodeRunner
from worker.drafter import DraftModel
from worker.eagle import EagleDrafter
from worker.input_batch import InputBatch, StepTensors
from worker.recurrent_state import RecurrentState
from worker.kv_groups import allocate_grouped_caches, kv_cache_groups
from worker.quantization.base import cast_model
from worker.kv_pool import KVPool, allocate_kv_caches
from worker.loader import load_model, resolve_dtype, resolve_scheme
from worker.lora import LoRAManager
from worker.multimodal import StepImages
from worker.memory_sizing import cuda_graph_bytes, kv_bytes_per_block, num_blocks_that_fit, profile_prefill
from worker.parallel import get_tp_group

log = logging.getLogger(__name__)


def resolve_device(name: str, rank: int = 0) -> torch.device:
    """The device with its index ("cuda" -> "cuda:N"): the kernels key per-device state (the
    split-KV workspace, resident slots) by the device every tensor reports. "auto" or "cuda" on a
    machine with GPUs: rank r of a tensor-parallel group gets the r-th GPU from the current one
    (GPU r where no process chose one), modulo the visible ones."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", (torch.cuda.current_device() + rank) % torch.cuda.device_count())
    return device


class ModelRunner:
    """One rank's model and KV pool: in a tensor-parallel group (`get_tp_group()` when built) its
    shard of the model and a pool of its KV heads, for the same block ids as every rank's."""

    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        self.config = config
        self._load(config, rank)
        self._warm_up_layers(config)
        # (the activations' bytes per token at the peak: measured on CUDA only)
        self.prefill_tokens_per_s, self.activation_bytes_per_token = profile_prefill(self)
        self._allocate_pools(config)
        self.decode_runner = None if self._eager_decode() else self._start_decode_runner()
        if config.compile and self.decode_runner is None:  # (auto stays quiet)
            log.warning("--compile: the decode step runs eagerly (--enforce-eager, a pooling model, or EAGLE)")
        # the last forward's rows that prompt logprobs score, then those pooling requests pool
        self.kept_hidden: torch.Tensor | None = None

    def _load(self, config: EngineConfig, rank: int) -> None:
        """The model (and a draft, and adapter slots) on this rank's device."""
        self.device = resolve_device(config.device, rank)
        self.world_size = get_tp_group().world_size
        if self.device.type == "cuda" and self.world_size > 1:
            torch.cuda.set_device(self.device)  # NCCL and the kernels use the current device
        self.source = resolve_model(config.model, config.revision, config.download_dir)
        self.scheme = resolve_scheme(config.quantization, self.source, self.device)
        self.dtype = resolve_dtype(config.dtype, self.device, self.scheme)
        self.kv_cache_dtype = kv_cache_dtype(config.kv_cache_dtype, self.dtype)  # the pools' (fp8, or the model's)
        # a pooling model's task (embeddings, a classifier's scores), None for a generative one
        overrides = hf_overrides(config.hf_overrides)
        self.pooler_config = pooler_config(self.source, config.runner, config.convert, overrides)
        self.model, self.hf_config = load_model(self.source, self.dtype, self.device, config.max_model_len, config.seed,
                                                self.scheme, self.pooler_config, overrides)
        self.max_model_len = self.model.max_positions
        if config.max_model_len is None and self.pooler_config is not None and self.pooler_config.max_seq_length:
            # a sentence-transformers model's max_seq_length bounds its inputs (vLLM caps the context by it)
            self.max_model_len = min(self.max_model_len, self.pooler_config.max_seq_length)
        # a draft model: loaded by every rank (its shapes size the pool alike), kept by rank 0
        self.drafter = self._load_drafter(config, rank)
        # the adapter slots, allocated before the profile run so the KV pool's sizing counts them
        self.lora = (LoRAManager(self.model, config.max_loras, config.max_lora_rank, config.max_cpu_loras, self.dtype,
                                 self.device) if config.enable_lora else None)
        if self.lora is not None:
            self.lora.warmup()  # CUDA: no LoRA kernel compiles while serving

    def _warm_up_layers(self, config: EngineConfig) -> None:
        """The KV cache's layout (groups, bytes per block), the kernels compiled for its layers'
        variants, and the linear-attention layers' state: all before the profile run."""
        self.sliding_window = self.model.sliding_window()  # every layer's, or None
        self.block_size = config.block_size
        attn = self.model.attention_layers()[0]
        # layers that attend differently (sliding and global) keep a block table each (worker/kv_groups.py)
        self.kv_groups = (None if self.pooler_config is not None or config.disable_hybrid_kv_cache_manager
                          else kv_cache_groups(self.model.attention_layers()))
        self._check_kv_groups(config)
        layers_per_block = (self.kv_groups.group_size if self.kv_groups is not None
                            else len(self.model.attention_layers()))
        self.kv_bytes_per_block = kv_bytes_per_block(layers_per_block, self.block_size,
                                                     attn.num_kv_heads, attn.head_dim, self.kv_cache_dtype)
        self.kv_bytes_per_block += self.draft_kv_bytes_per_block
        kernels.warmup(num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
                       block_size=self.block_size, dtype=self.dtype, device=self.device,
                       max_model_len=self.max_model_len,  # CUDA: nothing compiles while serving
                       attention_variants={(a.sliding_window, a.logit_softcap, a.sinks is not None)
                                           for a in self.model.attention_layers()},
                       kv_cache_dtype=self.kv_cache_dtype)
        self.model.warmup_kernels()  # a family's own (the fused MoE's tiles)
        # linear-attention layers' state, a slot per held sequence (before the profile run and the pool's sizing)
        self.recurrent = RecurrentState.of(self.model, config.max_num_seqs, self.dtype, self.device,
                                           checkpoints=config.max_num_seqs if config.enable_prefix_caching else 0)
        if self.recurrent is not None:
            log.info("recurrent state: %d slots and %d prefix-cache checkpoints (--max-num-seqs each), %.1f MiB",
                     self.recurrent.num_slots, self.recurrent.checkpoints,
                     (self.recurrent.num_slots + self.recurrent.checkpoints) * self.recurrent.bytes_per_slot / (1 << 20))

    def _allocate_pools(self, config: EngineConfig) -> None:
        """The KV pools sized by the profile run, and the input batch over them."""
        self.num_gpu_blocks = config.num_gpu_blocks or num_blocks_that_fit(
            config, self.device, self.kv_bytes_per_block, int(self.hf_config.vocab_size), self.world_size,
            self.activation_bytes_per_token)
        if config.max_model_len is None and config.num_gpu_blocks is None:
            self._fit_context(config)
        self.num_cpu_blocks = (
            config.num_cpu_blocks if config.num_cpu_blocks is not None
            else int(config.swap_space_gb * (1 << 30) // self.kv_bytes_per_block)
        )
        # one pool per model, the target's first: the draft's layers share its block ids and swap with them
        layers = [(self.model.attention_layers(), self.kv_cache_dtype)]
        if self.drafter is not None:
            layers.append((self.drafter.layers, self.drafter.kv_cache_dtype))
        if self.kv_groups is not None:
            caches = allocate_grouped_caches(layers[0][0], self.kv_groups, self.num_gpu_blocks, self.block_size,
                                             self.kv_cache_dtype, self.device)
            self.pools = [KVPool.on(caches, self.num_cpu_blocks)]
        else:
            self.pools = [KVPool.on(allocate_kv_caches(attns, self.num_gpu_blocks, self.block_size, dtype, self.device),
                                    self.num_cpu_blocks) for attns, dtype in layers]
        self.input_batch = InputBatch(config.max_num_seqs, -(-self.max_model_len // self.block_size),
                                      self.block_size, self.device, enable_lora=config.enable_lora,
                                      num_groups=len(self.kv_groups.windows) if self.kv_groups is not None else 1)
        self.input_batch.recurrent = self.recurrent is not None

    def _load_drafter(self, config: EngineConfig, rank: int) -> DraftModel | None:
        self.draft_kv_bytes_per_block = 0
        self.keeps_hidden = False  # EAGLE: the last forward's hidden states, kept
        self.last_hidden: torch.Tensor | None = None
        self._aux: list[torch.Tensor] = []  # EAGLE-3's, of the forward running
        spec = config.speculative
        if spec is None or not spec.drafts_on_worker:
            return None
        if spec.method in ("eagle", "eagle3"):  # rank 0 only (a group of one: the config refuses more)
            drafter = EagleDrafter(config, self.model, self.dtype, self.device, self.max_model_len,
                                   self.kv_cache_dtype)
            self.draft_kv_bytes_per_block = drafter.kv_bytes_per_block(config.block_size)
            self.keeps_hidden = True
            for i in drafter.aux_layers:  # EAGLE-3: the residual stream entering these layers
                self.model.layers[i].register_forward_pre_hook(self._capture_aux)
            self._warm_up_drafter(drafter)
            return drafter
        # the draft at its own context (or --max-model-len where given): the engine's is the shorter
        drafter = DraftModel(config, self.device, config.max_model_len, int(self.hf_config.vocab_size))
        self.max_model_len = min(self.max_model_len, drafter.max_positions)
        self.draft_kv_bytes_per_block = drafter.kv_bytes_per_block(config.block_size)
        if rank == 0:
            self._warm_up_drafter(drafter)
        return drafter if rank == 0 else None

    def _warm_up_drafter(self, drafter) -> None:
        """CUDA: the draft's (or head's) attention kernels compile now, not while serving."""
        if self.device.type == "cuda":
            a = drafter.layers[0]
            kernels.warmup(num_heads=a.num_heads, num_kv_heads=a.num_kv_heads, head_dim=a.head_dim,
                           block_size=self.config.block_size, dtype=drafter.dtype, device=self.device,
                           max_model_len=self.max_model_len, kv_cache_dtype=drafter.kv_cache_dtype,
                           attention_variants={(a.sliding_window, a.logit_softcap, a.sinks is not None)
                                               for a in drafter.layers})

    def _capture_aux(self, layer, args) -> None:
        h, residual = args[1], args[2]  # (positions, h, residual, rotary)
        self._aux.append(h if residual is None else h + residual)

    def _fit_context(self, config: EngineConfig) -> None:
        """No --max-model-len: the model's context, or the most one sequence can hold in the KV
        pool the memory gave (common/kv_capacity.py, as the scheduler admits) where that is less."""
        windows = self.kv_groups.windows if self.kv_groups is not None else [None]
        fits = tokens_that_fit(available_blocks(self.num_gpu_blocks), self.block_size, windows,
                               config.max_num_batched_tokens)
        if fits >= self.max_model_len:
            return
        if fits < self.block_size:
            raise ValueError(f"the KV cache ({self.num_gpu_blocks} blocks of {self.kv_bytes_per_block} bytes) holds "
                             "no sequence: give it more memory (--gpu-memory-utilization, --cpu-kv-cache-space)")
        log.warning("the model's context of %d tokens does not fit the KV cache (%d blocks of %d tokens): max_model_len "
                    "%d, what fits (--max-model-len sets it; more memory fits more)", self.max_model_len,
                    self.num_gpu_blocks, self.block_size, fits)
        self.max_model_len = fits
        rotary_embs = getattr(getattr(self.model, "model", None), "rotary_embs", None)
        if rotary_embs is not None:  # the rotary tables of this context, as --max-model-len would make them
            self.model.init_rope_cache(fits)  # (LongRoPE's factors, dynamic NTK's base follow the length)
            for rotary in rotary_embs.values():
                cast_model(rotary, self.dtype, self.device)

    def _check_kv_groups(self, config: EngineConfig) -> None:
        if self.kv_groups is None:
            return
        if self.drafter is not None or self.keeps_hidden:
            raise ValueError("speculative decoding with a draft model or EAGLE: not with KV cache groups (a model "
                             "with sliding-window and global layers) yet")
        windows = ", ".join(f"{w} tokens" if w else "global" for w in self.kv_groups.windows)
        log.info("KV cache groups: %d of %d layers each (%s)", len(self.kv_groups.windows), self.kv_groups.group_size,
                 windows)

    def _eager_decode(self) -> bool:
        if self.config.enforce_eager or self.keeps_hidden or self.pooler_config is not None:  # a pooler never decodes
            return True
        if self.recurrent is not None:
            log.info("a model with recurrent state: decode steps run eagerly (no CUDA graphs, no --compile)")
            return True
        if self.device.type == "cuda" and self.world_size > 1:
            # capturing NCCL collectives in CUDA graphs needs more care than it is worth here
            log.info("tensor parallelism on CUDA: decode steps run eagerly (no CUDA graphs)")
            return True
        return False

    def take_recompiles(self) -> int:
        """Graphs the compiled CPU decode step compiled while serving since the last call."""
        runner = self.decode_runner
        return 0 if runner is None or runner.compiled is None else runner.compiled.take_recompiles()

    def _start_decode_runner(self) -> DecodeRunner:
        """The static decode buffers; on CUDA their graphs, captured now that the KV pool exists."""
        # verify steps join the graphs by batch expansion on CUDA; on CPU the chunk
        # path's batched attention is the faster of the two
        runner = DecodeRunner(self.model, self.input_batch, self.config.max_num_seqs, self.device,
                              expand_short=self.device.type == "cuda")
        if self._compilable():
            runner.compile(explicit=self.config.compile is True)
        if self.device.type == "cuda":
            runner.capture()
            bound = cuda_graph_bytes(self.config.max_num_seqs, self.activation_bytes_per_token, len(runner.buckets))
            if runner.captured_bytes > bound:
                log.warning("the decode CUDA graphs took %.1f MiB, more than the %.1f MiB the KV pool's sizing "
                            "left for them: lower --gpu-memory-utilization if memory runs out",
                            runner.captured_bytes / (1 << 20), bound / (1 << 20))
        return runner

    def _compilable(self) -> bool:
        """Whether the decode step is compiled: `--compile`, or by default (auto) on one CPU rank
        without LoRA unless PAGODA_COMPILE=0 (the test suite's; a test about compiling asks)."""
        if self.config.compile is False or (self.config.compile is None and os.environ.get("PAGODA_COMPILE") == "0"):
            return False
        why = ("on CUDA the decode step runs as CUDA graphs" if self.device.type == "cuda"
               else "tensor parallelism" if self.world_size > 1
               else "LoRA adapters" if self.lora is not None else None)
        if why and self.config.compile:
            log.warning("--compile: the decode step runs eagerly (%s)", why)
        return why is None

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ step
    def update_inputs(self, changes: TableChanges) -> None:
        """The persistent input rows take a plan's table changes (`PlanState.changes`, once it applied the plan)."""
        self.input_batch.apply(changes)

    def reset(self) -> None:
        self.input_batch.reset()
        if self.recurrent is not None:
            self.recurrent.kept.clear()

    def prepare(self, scheduled: list[ScheduledSequence], feed: list[tuple[int, int]] = (),
                feed_tokens: torch.Tensor | None = None) -> StepTensors:
        """The step's tensors from the persistent input rows (worker/input_batch.py); `feed`: rows
        whose input id is the step before's draw, still on the device."""
        if self.recurrent is None:
            return self.input_batch.prepare(scheduled, feed, feed_tokens)
        self.recurrent.ensure(self.input_batch.num_rows)  # a slot per row, as the rows grow
        step = self.input_batch.prepare(scheduled, feed, feed_tokens)
        step.context.state_saves = self.recurrent.saves_of(scheduled)
        return step

    @torch.inference_mode()
    def forward(self, step: StepTensors, kept_indices: list[int] | None = None,
                images: StepImages | None = None) -> torch.Tensor | None:
        """Returns the logits of the sampling positions: [num_sampled, vocab_size] float32 (in a
        tensor-parallel group on rank 0; None on the others). `kept_indices`: flat rows whose
        hidden states are kept (`kept_hidden`): those whose logits prompt logprobs need
        (`scored_logits`), then those pooling requests pool; such a step runs eagerly. Every rank
        of a group passes the same indices. `images`: the rows images fill (worker/multimodal.py);
        such a step runs eagerly too."""
        if kept_indices or images is not None:
            kept = torch.tensor(kept_indices, dtype=torch.int64, device=self.device) if kept_indices else None
            return self.forward_eager(step, kept, images)
        if self.decode_runner is not None and self.decode_runner.can_run(step):
            return self.decode_runner.run(step)
        return self.forward_eager(step)

    @torch.inference_mode()
    def forward_eager(self, step: StepTensors, kept_indices: torch.Tensor | None = None,
                      images: StepImages | None = None) -> torch.Tensor | None:
        """The model on the step's own shapes (prefill, mixed steps, and everything with enforce_eager)."""
        self._aux.clear()
        with attention_context(step.context):
            if images is None:
                hidden = self.model(step.input_ids, step.positions)
            else:
                step.context.image_spans = images.spans
                positions = step.positions if images.positions is None else images.positions
                embedded = None if images.rows is None else (images.rows, images.embeddings)
                hidden = self.model(step.input_ids, positions, embedded)
        if self.keeps_hidden:
            self.last_hidden = torch.cat(self._aux, dim=-1) if self._aux else hidden
        self.kept_hidden = None if kept_indices is None else hidden[kept_indices]
        return self.model.compute_logits(hidden[step.logits_indices])

    @torch.inference_mode()
    def scored_logits(self, start: int, stop: int) -> torch.Tensor | None:
        """The logits of the scored rows [start, stop) of the last forward: [rows, vocab_size]
        float32 on rank 0 (None on the others, which must call it alike: it gathers over the group)."""
        return self.model.compute_logits(self.kept_hidden[start:stop])

    @torch.inference_mode()
    def load_loras(self, loads: list[list]) -> list[list]:
        """A plan's adapters into their slots (before its step; on CUDA in stream order after the
        steps launched before, which may still read a slot's old adapter). Returns [[slot, error]]
        for each that could not be loaded (its slot is left empty): the step runs on."""
        if loads and self.lora is None:
            raise ValueError("a plan loads a LoRA adapter into a worker started without --enable-lora")
        errors = []
        for slot, lora in loads:
            try:
                self.lora.load(slot, lora)
            except Exception as exc:  # a missing, changed or foreign adapter fails its own requests only
                log.warning("could not load LoRA adapter %r from %s: %s", lora.lora_name, lora.lora_path, exc)
                errors.append([slot, f"LoRA adapter {lora.lora_name!r} could not be loaded: {exc}"])
        return errors

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        return self.pools[0].caches

    @property
    def swap_caches(self) -> list[torch.Tensor]:
        """Every pool's host layers, the target's first."""
        return [cache for pool in self.pools for cache in pool.swap_caches]

    @torch.inference_mode()
    def copy_blocks(self, src_to_dst: list[list[int]]) -> None:
        for pool in self.pools:
            pool.copy_blocks(src_to_dst)

    @torch.inference_mode()
    def swap_out(self, device_to_cpu: list[list[int]]) -> None:
        # the gather is queued on the stream before the forward that reuses these blocks; the
        # copy to the host is asynchronous on CUDA (its host-side scatter runs later, in order)
        if device_to_cpu:
            for pool in self.pools:
                pool.swap_out(device_to_cpu)

    @torch.inference_mode()
    def swap_in(self, cpu_to_device: list[list[int]]) -> None:
        if cpu_to_device:
            for pool in self.pools:
                pool.swap_in(cpu_to_device)

    def synchronize_swaps(self) -> None:
        """Wait for the swaps queued so far (their host-side scatters included)."""
        for pool in self.pools:
            pool.synchronize()

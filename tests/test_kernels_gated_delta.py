"""The gated delta rule (kernels/gated_delta.py, kernels/triton_gated_delta.py): the reference
against transformers' own torch fallbacks (Qwen3-Next's chunked prefill and recurrent decode), a
prompt split into chunks continuing from its slot equal to it whole, the causal convolution with
its state; the Triton kernel against the reference under the interpreter, and compiled for sm_90."""
from __future__ import annotations

import pytest
import torch

import kernels
from kernels.gated_delta import causal_conv1d_reference, gated_delta_rule_reference
from tests.triton_env import DEVICE, INTERPRET, count_compiled_for_sm90, triton_test

HK, HV, DK, DV = 2, 4, 32, 24  # two value heads per key head; DV not a power of two


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    """Small tensors: intra-op threads only add overhead."""


def inputs(lens: list[int], seed: int = 0, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q, k = (torch.randn(t, HK, DK, generator=gen) for _ in range(2))
    v = torch.randn(t, HV, DV, generator=gen)
    g = -torch.rand(t, HV, generator=gen) * 2  # log decays <= 0
    beta = torch.rand(t, HV, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return *(x.to(dtype) for x in (q, k, v)), g, beta.to(dtype), cu


def transformers_rule(q, k, v, g, beta, initial=None, chunked=True):
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule,
    )

    run = torch_chunk_gated_delta_rule if chunked else torch_recurrent_gated_delta_rule
    return run(q[None], k[None], v[None], g[None], beta[None], initial_state=None if initial is None else initial[None],
               output_final_state=True, use_qk_l2norm_in_kernel=True)


def test_a_prompt_is_transformers_chunked_prefill_and_a_decode_its_recurrent_step():
    lens = [70, 1, 5]  # past one chunk of 64; a decode from its slot; a short prompt
    q, k, v, g, beta, cu = inputs(lens)
    state = torch.randn(4, HV, DK, DV) * 0.1
    before = state.clone()
    slots, fresh = torch.tensor([2, 0, 3]), torch.tensor([True, False, True])
    out = gated_delta_rule_reference(q, k, v, g, beta, cu, state, slots, fresh)
    for i, (slot, chunked) in enumerate(((2, True), (0, False), (3, True))):
        lo, hi = cu[i].item(), cu[i + 1].item()
        initial = None if fresh[i] else before[slot]
        o, final = transformers_rule(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], initial, chunked)
        torch.testing.assert_close(out[lo:hi], o[0], atol=1e-6, rtol=1e-5)  # (batched GEMMs round otherwise)
        torch.testing.assert_close(state[slot], final[0], atol=1e-6, rtol=1e-5)
    assert torch.equal(state[1], before[1])  # a slot no sequence names is untouched


def test_a_decode_step_runs_batched_as_each_sequence_steps_alone():
    """One token a sequence (every engine decode step): the rule and the convolution run batched
    with no host sync, equal to each sequence's own step (some from zeros, some from their slots)."""
    q, k, v, g, beta, cu = inputs([1] * 5, seed=4)
    state, conv_state = torch.randn(7, HV, DK, DV) * 0.1, torch.randn(7, 6, 3)
    slots, fresh = torch.tensor([6, 0, 3, 2, 5]), torch.tensor([False, True, False, True, False])
    from kernels.gated_delta import _recurrent

    batched_state = state.clone()
    batched = gated_delta_rule_reference(q, k, v, g, beta, cu, batched_state, slots, fresh)
    for i, slot in enumerate(slots.tolist()):  # the token-by-token form, a sequence at a time
        o, final = _recurrent(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1],
                              None if fresh[i] else state[slot], True)
        torch.testing.assert_close(batched[i], o[0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(batched_state[slot], final, atol=1e-6, rtol=1e-6)
    x, weight = torch.randn(5, 6), torch.randn(6, 4)
    batched_conv = conv_state.clone()
    y = causal_conv1d_reference(x, weight, cu, batched_conv, slots, fresh)
    for i, slot in enumerate(slots.tolist()):
        window = torch.cat([torch.zeros(6, 3) if fresh[i] else conv_state[slot], x[i, :, None]], dim=-1)
        torch.testing.assert_close(y[i], torch.nn.functional.silu((window * weight).sum(-1)), atol=1e-6, rtol=1e-6)
        assert torch.equal(batched_conv[slot], window[:, 1:])


def test_chunks_continuing_from_the_slot_equal_the_prompt_whole():
    q, k, v, g, beta, _ = inputs([90], seed=1)
    whole_state, parts_state = torch.zeros(1, HV, DK, DV), torch.zeros(1, HV, DK, DV)
    slot = torch.tensor([0])
    whole = gated_delta_rule_reference(q, k, v, g, beta, torch.tensor([0, 90]), whole_state, slot, torch.tensor([True]))
    parts = []
    for lo, hi in ((0, 30), (30, 31), (31, 90)):
        parts.append(gated_delta_rule_reference(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi],
                                                torch.tensor([0, hi - lo]), parts_state, slot, torch.tensor([lo == 0])))
    torch.testing.assert_close(torch.cat(parts), whole, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(parts_state, whole_state, atol=2e-5, rtol=2e-5)


def test_the_causal_convolution_continues_from_its_state():
    gen = torch.Generator().manual_seed(2)
    x, weight = torch.randn(12, 6, generator=gen), torch.randn(6, 4, generator=gen)
    conv_state = torch.zeros(2, 6, 3)
    whole = causal_conv1d_reference(x, weight, torch.tensor([0, 12]), conv_state.clone(), torch.tensor([1]),
                                    torch.tensor([True]))
    expected = torch.nn.functional.silu(torch.nn.functional.conv1d(x.t()[None], weight[:, None], padding=3,
                                                                   groups=6)[0, :, :12]).t()
    torch.testing.assert_close(whole, expected)
    parts = [causal_conv1d_reference(x[lo:hi], weight, torch.tensor([0, hi - lo]), conv_state, torch.tensor([1]),
                                     torch.tensor([lo == 0])) for lo, hi in ((0, 5), (5, 6), (6, 12))]
    torch.testing.assert_close(torch.cat(parts), whole)
    assert torch.equal(conv_state[1], x[9:].t()) and torch.equal(conv_state[0], torch.zeros(6, 3))


@triton_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_matches_the_recurrent_reference(dtype):
    """Sequences of every kind in one launch: fresh prompts, a chunk after its slot, decodes, an
    empty one; a value head dim split over two programs (BLOCK_V 16 < 24)."""
    lens = [9, 1, 0, 3, 1]
    q, k, v, g, beta, cu = inputs(lens, seed=3, dtype=dtype)
    state = torch.randn(6, HV, DK, DV) * 0.1
    slots, fresh = torch.tensor([4, 1, 0, 5, 2]), torch.tensor([True, False, False, False, False])
    expected_state = state.clone()
    expected = gated_delta_rule_reference(q, k, v, g, beta, cu, expected_state, slots, fresh, chunked=False)
    move = (lambda x: x.to(DEVICE))
    got_state = move(state.clone())
    from kernels import triton_gated_delta

    for block_v in (None, 16):
        got_state = move(state.clone())
        got = triton_gated_delta.gated_delta_rule(*map(move, (q, k, v, g, beta, cu, )), got_state, move(slots),
                                                  move(fresh), block_v=block_v)
        tol = {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 2e-3, "rtol": 2e-3}
        torch.testing.assert_close(got.cpu().float(), expected.float(), **tol)
        torch.testing.assert_close(got_state.cpu(), expected_state, atol=2e-5, rtol=2e-5)
    assert torch.equal(got_state.cpu()[0], state[0]) and torch.equal(got_state.cpu()[3], state[3])  # untouched


def test_dispatch_off_cuda_is_the_reference():
    q, k, v, g, beta, cu = inputs([4, 1])
    a, b = torch.zeros(2, HV, DK, DV), torch.zeros(2, HV, DK, DV)
    args = (torch.tensor([1, 0]), torch.tensor([True, True]))
    assert torch.equal(kernels.gated_delta_rule(q, k, v, g, beta, cu, a, *args),
                       gated_delta_rule_reference(q, k, v, g, beta, cu, b, *args))


def _compile_for_sm90() -> list[str]:
    """The kernel for Qwen3-Next's shapes (k and v head dims 128) in bfloat16 and float32."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels import triton_gated_delta as tg

    done = []
    fn = tg._gated_delta_kernel
    for dtype in ("bf16", "fp32"):
        types = {name: f"*{dtype}" for name in ("q_ptr", "k_ptr", "v_ptr", "beta_ptr", "out_ptr")}
        types |= {"g_ptr": "*fp32", "state_ptr": "*fp32", "cu_seqlens_ptr": "*i32", "slots_ptr": "*i64",
                  "fresh_ptr": "*i8", "scale": "fp32"}
        consts = dict(NUM_V_HEADS=32, GROUP=2, DK=128, DV=128, DK_P2=128, BLOCK_V=32, L2NORM=True)
        sig = {name: "constexpr" if name in consts else types.get(name, "i32") for name in fn.arg_names}
        aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name.endswith("_ptr")}
        kernel = triton.compile(ASTSource(fn, sig, consts, aligned), target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": 4})
        assert kernel.asm["ptx"]
        done.append(f"{fn.__name__} {dtype}")
    return done


@pytest.mark.skipif(not INTERPRET, reason="on a GPU the kernels are compiled for the device itself")
def test_the_kernel_compiles_for_hopper_without_a_gpu():
    assert count_compiled_for_sm90("tests.test_kernels_gated_delta", "_compile_for_sm90") == 2

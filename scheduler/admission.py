"""Which requests the scheduler admits: those that can ever be served (common/admission.py's
limits, here over the scheduler's pool), a base of Scheduler over its `block_manager`, `config`
and `groups`."""
from __future__ import annotations

from common.admission import AdmissionLimits, check_admissible, final_len, num_seqs, sequences_param
from common.protocol import MultiModalItem, SamplingParams
from scheduler.sequence import SequenceGroup


class RequestRejected(ValueError):
    """A request that can never be served (too long for the context or for the whole pool)."""


class RequestAdmission:
    def _max_new_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        return final_len(num_prompt_tokens, params, self.max_model_len) - num_prompt_tokens

    def _check_admissible(self, request_id: str, prompt: list[int], params: SamplingParams,
                          mm_items: list[MultiModalItem] | None = None) -> None:
        if request_id in self.groups:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        rejection = check_admissible(len(prompt), params, self.admission_limits)
        if rejection is not None:
            raise RequestRejected(rejection.message)
        seqs = num_seqs(params)
        if seqs > 1 and self.block_manager.allocates_chunks:  # a window's blocks are each sequence's
            length = final_len(len(prompt), params, self.max_model_len)
            if length > self.block_manager.max_tokens(self.config.max_num_batched_tokens, seqs):
                raise RequestRejected(f"the request's {seqs} sequences of up to {length} tokens need more KV cache "
                                      "than the server's whole pool; shorten the prompt, lower max_tokens or lower "
                                      f"{sequences_param(params)}")
        if mm_items and params.prompt_logprobs is not None:
            raise RequestRejected("prompt_logprobs cannot score a prompt with images")
        budget = self.config.max_num_batched_tokens
        if any(item.bidirectional and item.length > budget for item in mm_items or ()):
            raise RequestRejected(f"an image of this request takes more tokens than --max-num-batched-tokens "
                                  f"({budget}), and its tokens must be computed in one step")

    @property
    def admission_limits(self) -> AdmissionLimits:
        config = self.config
        return AdmissionLimits(self.max_model_len, self.block_manager.block_size, self.max_request_tokens,
                               config.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill,
                               self.pooling_task)

    @property
    def max_request_tokens(self) -> int:
        """The most tokens one request may hold: the pool less the watermark `allocate` keeps."""
        return self.block_manager.max_tokens(self.config.max_num_batched_tokens)

    def _final_tokens(self, group: SequenceGroup) -> int:
        return final_len(len(group.prompt_token_ids), group.sampling_params, self.max_model_len)

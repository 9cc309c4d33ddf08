"""``jspec.LLM``: the front door in vLLM's convention.

    from jspec import LLM, SamplingParams
    llm = LLM(model="smollm2-135m", speculative_config={"method": "ngram", "num_speculative_tokens": 4},
              max_num_seqs=8)
    outputs = llm.generate(["def fib(n):", "The capital of France is"], SamplingParams(max_tokens=64))
    outputs[0].outputs[0].text, outputs[0].outputs[0].token_ids, outputs[0].outputs[0].finish_reason
    outputs[0].metrics.ttft, outputs[0].metrics.mean_acceptance_length

``tensor_parallel_size=N`` shards the target over N devices (:mod:`jspec.parallel`; after
``jspec.parallel.initialize_distributed()`` the devices may span hosts).

``generate`` takes one prompt (a string), or a list of prompts (strings, token-id lists, or
``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}`` dicts), with one ``SamplingParams`` for
all or one per prompt, and returns one :class:`RequestOutput` per prompt in order. For
streaming, ``llm.stream(...)`` yields outputs as tokens arrive, and ``llm.engine`` offers
``add_request`` / ``step()`` / ``abort_request``.

A prompt whose request fails in the engine comes back finished with finish reason ``"error"``
(and ``RequestOutput.error``) while the others complete (:mod:`jspec.engine.engine`). If a call
is cut short (an exception ``step()`` raises, an interrupt, a stream the caller stops reading),
its unfinished requests are aborted, so the engine is left idle and ready for the next call.
"""

from __future__ import annotations

import itertools
from typing import Iterator, Optional, Sequence, Union

from jspec.config import EngineConfig, SamplingParams, SpecConfig
from jspec.engine.engine import LLMEngine
from jspec.engine.generate import normalize_prompts
from jspec.engine.progress import Progress
from jspec.engine.request import RequestOutput
from jspec.errors import ConfigError, PromptError
from jspec.loading import DEFAULT_MODEL, LoadedModel, load_model


def _prompt_of(p):
    if isinstance(p, dict):
        if "prompt_token_ids" in p:
            return p["prompt_token_ids"]
        if "prompt" in p:
            return p["prompt"]
        raise PromptError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(p)}")
    return p


class LLM:
    def __init__(self, model: Union[str, LoadedModel] = DEFAULT_MODEL, *, speculative_config: Optional[dict] = None,
                 max_num_seqs: int = 8, max_num_batched_tokens: int = 512, max_model_len: Optional[int] = None,
                 kv_cache_tokens: Optional[int] = None, memory_utilization: float = 0.9, page_size: int = 16,
                 enable_prefix_caching: bool = True,
                 max_burst_steps: int = 16, dtype: str = "float32", attention: str = "auto", seed: int = 0,
                 tensor_parallel_size: int = 1, quantized_weights: bool = True, kv_cache_dtype: str = "auto",
                 quantized_activations: bool = False):
        config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                              max_model_len=max_model_len, kv_cache_tokens=kv_cache_tokens,
                              memory_utilization=memory_utilization, page_size=page_size,
                              enable_prefix_caching=enable_prefix_caching, max_burst_steps=max_burst_steps,
                              attention=attention, seed=seed, tensor_parallel_size=tensor_parallel_size,
                              quantized_weights=quantized_weights, kv_cache_dtype=kv_cache_dtype,
                              quantized_activations=quantized_activations)
        spec = SpecConfig.from_dict(speculative_config)
        if isinstance(model, LoadedModel):
            self.model = model
        elif isinstance(model, str):
            self.model = load_model(model, dtype=dtype)
        else:
            raise ConfigError(f"model must be a name, a path or a LoadedModel, got {type(model).__name__}")
        self.engine = LLMEngine(self.model, config, spec)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.model.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget the cached prompt pages (as vLLM's ``LLM.reset_prefix_cache``): the next
        prompts prefill from scratch. Returns False while requests are unfinished."""
        return self.engine.reset_prefix_cache()

    def _add(self, prompts, sampling_params, chat: bool) -> list[str]:
        prompts = normalize_prompts(prompts)
        if sampling_params is None:
            params = [SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ConfigError(f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts")
            params = list(sampling_params)
        else:
            raise ConfigError(f"sampling_params must be a SamplingParams or a list of them, "
                              f"got {type(sampling_params).__name__}")
        ids = []
        added = []
        try:
            for p, sp in zip(prompts, params):
                rid = f"req-{next(self._ids)}"
                self.engine.add_request(rid, _prompt_of(p), sp, chat=chat)
                added.append(rid)
                ids.append(rid)
        except BaseException:  # all or nothing: a bad prompt queues none of the batch
            for rid in added:
                self.engine.abort_request(rid)
            self.engine.pop_finished()
            raise
        return ids

    def generate(self, prompts, sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None, *,
                 use_tqdm: bool = True, chat: bool = False) -> list[RequestOutput]:
        """Run ``prompts`` to completion; one RequestOutput per prompt, in order. ``use_tqdm``
        (vLLM's flag) shows a bar of finished requests on stderr with the output tokens per
        second and, when speculating, the draft acceptance rate of this call."""
        ids = self._add(prompts, sampling_params, chat)
        bar = Progress(self.engine, len(ids)) if use_tqdm else None
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        try:
            for outs in self.engine.step_until_done(until=lambda: len(done) == len(ids)):
                for out in outs:
                    if out.finished and out.request_id in wanted and out.request_id not in done:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.finished(len(out.outputs[0].token_ids))
            for rid in ids:  # finished without an output in a step (aborted): take their record
                if rid not in done:
                    done[rid] = self.engine.requests[rid].to_output()
        finally:
            if bar is not None:
                bar.close()
            self._forget(ids)
        return [done[rid] for rid in ids]

    def _forget(self, ids) -> None:
        """Abort what is unfinished of ``ids`` (a call cut short) and drop their records."""
        for rid in ids:
            if self.engine.requests.get(rid) is not None:
                self.engine.abort_request(rid)
            self.engine.requests.pop(rid, None)

    def stream(self, prompts, sampling_params=None, *, chat: bool = False) -> Iterator[RequestOutput]:
        """Yield each request's output whenever it has new tokens (the final one has
        ``finished`` True); ``outputs[0].token_ids`` holds only the new tokens."""
        ids = set(self._add(prompts, sampling_params, chat))
        remaining = set(ids)
        try:
            for outs in self.engine.step_until_done(until=lambda: not remaining):
                for out in outs:
                    if out.request_id in ids:
                        r = self.engine.requests[out.request_id]
                        if out.finished:
                            remaining.discard(out.request_id)
                            self.engine.requests.pop(out.request_id, None)
                        inc = r.to_output(incremental=True)
                        r.emitted = len(r.output_ids)
                        yield inc
        finally:  # the caller stopped reading, or a step raised: nothing of this call is left behind
            self._forget(remaining)

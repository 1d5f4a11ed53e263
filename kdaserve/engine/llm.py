"""Offline generation: `LLM(model=dir).generate(prompts, SamplingParams(...))`; prompts may
carry images (`{"prompt": ..., "multi_modal_data": {"image": PIL.Image}}`) and `LLM.chat`
takes OpenAI-style messages with `image_url` parts."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any, Union

from tqdm.auto import tqdm

from kdaserve.config import EngineConfig
from kdaserve.engine.args import EngineArgs
from kdaserve.engine.core import EngineCore
from kdaserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kdaserve.image_io import ImageLimits, check_count, load_image
from kdaserve.media import MediaItem
from kdaserve.request import SamplingParams
from kdaserve.vision_input import VisionInput, split_chat_images

PromptType = Union[str, dict[str, Any], list[int]]


class LLM:
    def __init__(self, model: str | None = None, *, shared_weights: LLM | None = None,
                 **kwargs: Any) -> None:
        """`kwargs`: the fields of `EngineArgs` (engine/args.py, with their defaults), e.g.
        `max_model_len`, `cache_memory` (bytes), `enable_prefix_caching`; an unknown name is a
        TypeError. `offload`: "host", "disk" or "host,disk" (evicted prefix-cache entries go
        there); `offload_bytes`: one cap, or one per tier; `offload_dir`: the disk tier's
        directory. `max_decode_slowdown=0`: a schedule that follows the token budget alone,
        the same on every run (the decode guard's chunks follow measured step times, and a
        prompt chunked elsewhere can change a greedy token where two logits nearly tie).

        Under torchrun (docs/parallelism.md) every rank runs the script: on rank 0 this is
        the engine; on any other rank the constructor runs that rank's worker loop until rank
        0 shuts down and then ends the process (the rest of the script runs on rank 0 only).
        `ray_address`: with distributed_executor="ray", the cluster to join.
        `shared_weights`: another in-process LLM of the same model whose weights this one
        serves, the same bytes in memory, not a second load (`kdaserve bench spec`'s token
        and block engines: two loads of the demo differed by 2-6% in speed, from where their
        pages fell)."""
        self.config = EngineArgs.from_kwargs("LLM()", model=model, **kwargs).to_engine_config()
        path = self.config.model
        from kdaserve.engine.executor.torchrun import is_torchrun_worker, run_torchrun_rank

        if is_torchrun_worker(self.config.parallel):
            raise SystemExit(run_torchrun_rank(self.config))
        if shared_weights is not None:
            _check_sharable(shared_weights.config, self.config)
        self.engine = EngineCore(self.config, progress=True, model=(
            shared_weights.engine.model if shared_weights is not None else None))
        self.tokenizer = self.engine.tokenizer
        self.vision = (VisionInput.for_model(path, self.tokenizer)
                       if self.engine.vision_config is not None else None)
        self.image_limits = ImageLimits()
        self._ids = itertools.count()

    def close(self) -> None:
        """Hand what the device cache holds to the offload tiers (the disk tier keeps it for
        the next run). The engine stays usable."""
        self.engine.close()

    def shutdown(self) -> None:
        """Stop the engine's worker processes (multi-process layouts); the LLM is unusable
        afterwards."""
        self.engine.shutdown()

    def _prompt_media(self, prompt: PromptType) -> tuple[str | None, list[int], list[MediaItem]]:
        text, ids = self._prompt_ids(prompt)
        mm = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if not mm:
            return text, ids, []
        if set(mm) - {"image"}:
            raise ValueError(f"multi_modal_data: only 'image' is supported, got {sorted(mm)}")
        images = mm["image"] if isinstance(mm["image"], (list, tuple)) else [mm["image"]]
        if self.vision is None:
            raise ValueError("this model has no vision tower (or its tokenizer no media "
                             "placeholder); images are not supported")
        check_count(len(images), self.image_limits)
        if text is not None and self.vision.placeholder_id not in ids and len(images) == 1:
            ids = [self.vision.placeholder_id] + ids      # one image, no placeholder: in front
        ids, media = self.vision.expand(ids, images)
        return text, ids, media

    def _prompt_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass {'prompt_token_ids': [...]}")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._prompt_ids(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        return None, list(prompt)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("sampling_params must be one, or one per prompt")
        results: dict[str, RequestOutput] = {}
        order = []
        for prompt, sp in zip(prompts, params_list):
            text, ids, media = self._prompt_media(prompt)
            rid = str(next(self._ids))
            self.engine.add_request(rid, ids, sp, media=media, stream_text=False)
            order.append(rid)
            results[rid] = RequestOutput(rid, text, ids, [
                CompletionOutput(i, "", [], logprobs=[] if sp.logprobs is not None else None)
                for i in range(sp.n)], finished=False,
                metrics=RequestMetrics(time.perf_counter()))
        pending = {rid: len(results[rid].outputs) for rid in order}
        bar = tqdm(total=len(order), desc="Generating", unit="req", disable=not use_tqdm)
        try:
            while pending:
                deltas = self.engine.step()
                now = time.perf_counter()
                for d in deltas:
                    out = results[d.request_id]
                    comp = out.outputs[d.index]
                    if d.new_token_ids:
                        m = out.metrics
                        m.last_token_time = now
                        if m.first_token_time is None:
                            m.first_token_time = now
                    comp.text += d.new_text
                    comp.token_ids.extend(d.new_token_ids)
                    if comp.logprobs is not None and d.new_logprobs:
                        comp.logprobs.extend(d.new_logprobs)
                    out.num_cached_tokens = d.num_cached_tokens
                    if d.prompt_logprobs is not None:
                        out.prompt_logprobs = d.prompt_logprobs
                    if d.finished:
                        comp.finish_reason, comp.stop_reason = d.finish_reason, d.stop_reason
                        comp.acceptance_length = d.acceptance_length
                        comp.spec_verifications = d.spec_verifications
                        if d.error is not None:       # the engine failed this request only
                            comp.stop_reason = d.error
                        pending[d.request_id] -= 1
                        if not pending[d.request_id]:
                            del pending[d.request_id]
                            out.finished = True
                            out.metrics.finished_time = now
                            bar.update(1)
        except BaseException:
            for rid in pending:
                self.engine.abort(rid)
            raise
        finally:
            bar.close()
        return [results[rid] for rid in order]

    def chat(self, messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             **template_kwargs: Any) -> list[RequestOutput]:
        """OpenAI-style messages (one conversation, or a list of them); content may hold
        `image_url` parts (data URLs, as the server takes them)."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts: list[PromptType] = []
        for conv in convs:
            conv, refs = split_chat_images(conv, self.vision.marker if self.vision else None)
            text = self.tokenizer.apply_chat_template(
                conv, add_generation_prompt=add_generation_prompt, **template_kwargs)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            prompt: dict[str, Any] = {"prompt": text, "prompt_token_ids": ids}
            if refs:
                check_count(len(refs), self.image_limits)
                prompt["multi_modal_data"] = {
                    "image": [load_image(url, self.image_limits) for _, _, url in refs]}
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)


def _check_sharable(owner: EngineConfig, config: EngineConfig) -> None:
    """A model is prepared for its first engine (dtype, quantization, MoE backend, device):
    another engine may serve it only as prepared, in one process."""
    keys = ("model", "dtype", "device", "quantization", "quantization_group_size")
    diff = [k for k in keys if getattr(owner, k) != getattr(config, k)]
    if owner.parallel.executor != "uni" or config.parallel.executor != "uni":
        diff.append("distributed_executor")
    if owner.parallel.moe_backend != config.parallel.moe_backend:
        diff.append("moe_backend")
    if diff:
        raise ValueError(f"shared_weights: the engines differ in {', '.join(diff)}; an engine "
                         f"serves another's weights only as that one prepared them")

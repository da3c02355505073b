"""Which request kinds a runner serves, and (with prompt embeddings or multimodal inputs) the
persistent `inputs_embeds` buffer its first stage reads.
"""

from __future__ import annotations

from graphrunner.protocol import SchedulerOutput


def check_request_kinds(so: SchedulerOutput, *, pooling: bool, prompt_embeds: bool, multimodal: bool) -> None:
    """ValueError naming the first new request of a kind this runner does not serve: a pooling request
    on a generative runner (or the reverse), prompt embeddings without `enable_prompt_embeds`, or
    multimodal inputs for a text-only model. Changes nothing."""
    for new in so.scheduled_new_reqs:
        if (new.pooling_params is not None) != pooling:
            raise ValueError(
                f"request {new.req_id!r} is a pooling request (pooling_params set) and this runner generates"
                if not pooling else
                f"request {new.req_id!r} has no pooling_params: a pooling runner serves pooling requests only")
        if new.prompt_embeds is not None and not prompt_embeds:
            raise ValueError(f"request {new.req_id!r} carries prompt_embeds but the model was loaded without "
                             "enable_prompt_embeds=True")
        if new.mm_features and not multimodal:
            kinds = sorted({f.modality for f in new.mm_features})
            raise ValueError(f"request {new.req_id!r} carries {len(new.mm_features)} multimodal input(s) {kinds} "
                             "but the model is text-only")

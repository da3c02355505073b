"""Multi-LoRA serving: many adapters over one base model, in one batch.

- `peft.py`      a PEFT folder (`adapter_config.json` + `adapter_model.safetensors`) read and checked
                 against the model: per layer and projection the A [r, in] and B [out, r] tensors and the
                 scaling (`lora_alpha / r`, or `/ sqrt(r)` under rsLoRA).
- `kernels.py`   the shrink (x A^T) and expand (h B^T added into the base output) Triton kernels over
                 token rows grouped by slot, and their torch reference.
- `weights.py`   `LoraWeights`: one projection's persistent stacked A/B slots (every slot padded to
                 `max_lora_rank`; loads copy into a slot, so addresses never change and graphs stay valid)
                 and its tensor-parallel split; `LoraBuffers`: the per-step slot metadata the kernels read.
- `manager.py`   `LoraManager`: the runner's host side: adapters per request, an LRU of `max_cpu_loras`
                 adapters in host memory and one of `max_loras` device slots, the per-step upload.

`graphrunner.protocol.LoRARequest` (vLLM's) names the adapter a request runs with.

Nothing here runs for a batch without adapters: such a batch replays the graphs captured without
LoRA (capture/dispatch.py keys graphs by `has_lora`).
"""

"""Multimodal inputs and prompt embeddings: what the first stage reads instead of token embeddings.

features: what a request carries (vLLM's `MultiModalFeatureSpec`, `PlaceholderRange`); embeds: the
persistent `inputs_embeds` buffer and the per-step staging of prompt embeddings and encoder outputs
into it; cache: the runner's encoder cache, keyed by the input's content hash; processor: image
preprocessing from the checkpoint's own processor config; scheduling: the engine's encoder budget
and cache bookkeeping.
"""

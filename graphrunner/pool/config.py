"""PoolerConfig: how a pooling model turns a prompt's hidden states into one vector.

Read from the checkpoint folder the way vLLM reads it: a sentence-transformers `modules.json`
names the pooling module (`1_Pooling/config.json`: last token, mean or CLS) and whether a
`Normalize` module follows; a `*ForSequenceClassification` config.json names the labels of its
`score` head. A folder without `modules.json` pools the last token and normalises (vLLM's default
for decoder embedders such as Qwen3-Embedding).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graphrunner.models.registry import is_builtin

POOLING_TYPES = ("LAST", "MEAN", "CLS")

# sentence-transformers Pooling config keys -> pooling type (the first one set wins).
_ST_MODES = (("pooling_mode_lasttoken", "LAST"), ("pooling_mode_mean_tokens", "MEAN"),
             ("pooling_mode_cls_token", "CLS"))
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class PoolerConfig:
    """pooling_type: "LAST" (the prompt's last token), "MEAN" (every token's average) or "CLS" (the
    first token). normalize: the default of `PoolingParams.normalize` for embeddings. num_labels:
    the classifier's labels (its `score` head is [num_labels, hidden]); 0 for an embedder."""

    pooling_type: str = "LAST"
    normalize: bool = True
    num_labels: int = 0

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type={self.pooling_type!r}; allowed: {list(POOLING_TYPES)}")
        if isinstance(self.num_labels, bool) or not isinstance(self.num_labels, int) or self.num_labels < 0:
            raise ValueError(f"num_labels={self.num_labels!r} must be an int >= 0")

    @property
    def is_classifier(self) -> bool:
        return self.num_labels > 0

    @property
    def tasks(self) -> tuple[str, ...]:
        """The `PoolingParams.task`s this model serves: a classifier classifies (and scores pairs, as
        a cross-encoder, with one label); an embedder embeds (and scores pairs by cosine similarity)."""
        return ("classify", "score", "encode") if self.is_classifier else ("embed", "score", "encode")

    @property
    def chunkable(self) -> bool:
        """Whether a prompt may be prefilled over several steps: the last token's hidden state sees
        the whole prompt through the KV cache; a mean or the first token needs every position at once."""
        return self.pooling_type == "LAST"


def load_pooler_config(model: str) -> PoolerConfig:
    """The pooler of a checkpoint folder (module docstring); builtins: last token, normalised.
    ValueError naming the file for a pooling mode graphrunner does not implement."""
    if is_builtin(model):
        return PoolerConfig()
    folder = Path(model)
    raw = _read(folder / "config.json") or {}
    archs = raw.get("architectures") or []
    num_labels = 0
    if any(str(a).endswith("ForSequenceClassification") for a in archs):
        labels = raw.get("id2label")
        num_labels = len(labels) if isinstance(labels, dict) and labels else int(raw.get("num_labels", 2))
    modules = _read(folder / "modules.json")
    if not isinstance(modules, list):
        return PoolerConfig(num_labels=num_labels)
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    pooling_type = "LAST"
    if "Pooling" in kinds:
        path = folder / str(kinds["Pooling"].get("path", "")) / "config.json"
        pooling = _read(path) or {}
        bad = [key for key in _ST_UNSUPPORTED if pooling.get(key)]
        if bad:
            raise ValueError(f"{str(path)!r} sets {bad}; graphrunner pools by {list(POOLING_TYPES)} only")
        pooling_type = next((kind for key, kind in _ST_MODES if pooling.get(key)), "LAST")
    return PoolerConfig(pooling_type=pooling_type, normalize="Normalize" in kinds, num_labels=num_labels)


def _read(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(path)!r} is not valid JSON: {e.msg} at line {e.lineno}") from e

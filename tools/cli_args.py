"""Command-line arguments shared by `graphrunner bench` and `graphrunner inspect`.

Kept free of torch so that building the parser stays cheap.
"""

from __future__ import annotations


def add_runner_args(p, *, model: str = "builtin:qwen2.5-0.5b") -> None:
    """The command-line arguments that say how a runner is built (bench and inspect share them)."""
    p.add_argument("--model", default=model, help="builtin:NAME (dummy weights) or a Hugging Face checkpoint folder")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), float32, float16, bfloat16")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument(
        "--compile-backend",
        default=None,
        choices=("inductor", "aot_eager", "eager"),
        help="compiles the model for graph modes (and the HF peer); default inductor on CUDA, eager on CPU",
    )
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"), help="builtins always use dummy weights")
    p.add_argument("--seed", type=int, default=0, help="seeds dummy weights, prompts and the random KV fill")

"""Debug: why a Gumbel-max row differs between the Triton kernel and torch (CUDA)."""
import torch

from graphrunner.sample import rng
from graphrunner.sample.triton_sampling import gumbel_argmax_torch, gumbel_argmax_triton, sampling_threshold_torch
from tests.test_triton_sampling import _batch, _filters

rows, vocab = 64, 151936
for seed in (1, 2, 3):
    x, temperature, keys = _batch(seed, rows, vocab, device="cuda")
    top_k, top_p, min_p = _filters(0, rows, vocab, device="cuda")
    top_k = torch.where(top_k % 2 == 0, top_k % 200, top_k)
    thr = torch.empty(rows, device="cuda")
    sampling_threshold_torch(x, temperature, top_k, top_p, min_p, True, True, True, thr)
    want = torch.empty(rows, dtype=torch.int64, device="cuda")
    got = torch.empty(rows, dtype=torch.int64, device="cuda")
    gumbel_argmax_torch(x, temperature, keys, thr, want)
    for splits in (1, None):
        gumbel_argmax_triton(x, temperature, keys, thr, got, splits=splits)
        bad = (got != want).nonzero().flatten().tolist()
        print(f"seed {seed} splits {splits}: {len(bad)} rows differ {bad}")
        for r in bad[:3]:
            t = temperature[r].item()
            tt = 1.0 if t == 0 else t
            s = x[r] / tt
            g = rng.gumbel(keys[r:r + 1], vocab)[0]
            val = torch.where(s < thr[r], float("-inf"), s) + (0 if t == 0 else 1) * g
            a, b = int(want[r]), int(got[r])
            print(f"  row {r} T={t:.4f} thr={thr[r].item():.6f} torch tok {a}: s={s[a].item():.7f} g={g[a].item():.7f} "
                  f"val={val[a].item():.7f} | triton tok {b}: s={s[b].item():.7f} g={g[b].item():.7f} val={val[b].item():.7f}"
                  f" kept={(s >= thr[r]).sum().item()}")

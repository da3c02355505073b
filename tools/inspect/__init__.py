"""`graphrunner inspect`: what was captured, what it cost, and which graph a batch uses.

Subcommands (tools/inspect/cli.py parses them; each has a module of its own):

    table      capture sizes, mode resolution, per token count the ordered candidates  (table.py)
    explain    the descriptor one batch gets and why, with its padding waste           (explain.py)
    capture    capture a runner and show its CaptureReport; --dot writes one graph     (capture_cmd.py)
               nodes per layer and kernel families of its graphs                       (node_families.py)
    replay     FULL-graph step latency vs the same batch run eagerly                   (replay.py)
    simulate   dispatch over a recorded or synthesised batch trace: hit rates, waste   (simulate.py,
                                                                                        workloads.py)

`table`, `explain` and `simulate` build no model and need no GPU; `capture` and
`replay` build a runner with dummy weights and also run on a CPU (FULL graphs emulated).
With `--speculative-config`, table/explain mark the q = 1 + k verifying descriptors
(speculation.py) and capture reports the verifying graphs and the drafter's nodes (drafter.py).
"""

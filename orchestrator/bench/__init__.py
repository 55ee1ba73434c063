"""`weir bench`: the fixed-backend serving benchmark.

One module per idea: `workloads` builds sessions of token-id prompts, `targets` sends one turn
to an OpenAI-compatible server or straight to a Weir worker and times it, `load` schedules
sessions (closed loop, Poisson, trace), `stats` turns request records into figures, `report`
prints and writes them, `plots` draws them. The command itself is `orchestrator/cli/bench.py`.
"""

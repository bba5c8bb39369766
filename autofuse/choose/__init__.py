"""Which candidate runs for a problem: the runtime's one decision, and the rule the tuner stores by.

    policy.py      DecisionPolicy: every threshold that decides between candidates (margins, near ties,
                   host-bound time, the one-launch MLP's reach, the un-graphed race), one object
    choice.py      Choice (a kernel config or a library path) and Source (where it came from)
    lookup.py      what the caches hold: user cache, then shipped files, then the nearest key, then
    heuristics.py  the built-in heuristic
    check.py       first-use checks of choices nothing compared on this GPU (no unchecked config runs)
    winner.py      the winner rule a tuning run and a check apply to what they timed
    plans.py       module plans as data (a Linear; an MLP's gated_up + down, gated_pairs + down or one
                   launch) and `select`, which turns a plan into the table a module runs
    race.py        un-graphed calls: the table whose plain call (host time included) is fastest

Modules, the torch.library ops, training and `dispatch.call` all decide through `plans.select` /
`plans.resolve_checked`; the tuner reads the policy, the heuristic and the winner rule from here.
"""

from .choice import Choice, Source, pending
from .lookup import generation, invalidate, remember
from .plans import LinearPlan, MLPPlan, resolve_checked, select, table_key
from .policy import DecisionPolicy, current, use

__all__ = ["Choice", "DecisionPolicy", "LinearPlan", "MLPPlan", "Source", "current", "generation", "invalidate",
           "pending", "remember", "resolve_checked", "select", "table_key", "use"]

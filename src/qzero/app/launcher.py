"""What a launcher (torchrun) leaves in the environment, and processes started without it.

[Note: launcher variables]
torchrun gives each process it starts the variables of its rank (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ...) and of its agent (``TORCHELASTIC_USE_AGENT_STORE``: the rendezvous store
is the agent's, hosted at ``MASTER_PORT``; ``TORCHELASTIC_RUN_ID``, ...). A process of ours that
starts ranks of its own (``qzero train`` outside torchrun, every arm of ``qzero qualify``) must
start them with *none* of these: a rank that still reads ``TORCHELASTIC_USE_AGENT_STORE=True``
waits forever for a store that is not its own, and one that reads the launcher's ``RANK`` joins
the wrong job. :func:`without_launcher` is that environment; :func:`under_torchrun` tells
whether this process is one of a launcher's ranks.
"""

from __future__ import annotations

import os

#: The variables of a rank and of its agent that torchrun sets (``TORCHELASTIC_*`` besides).
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                  "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
AGENT_PREFIX = "TORCHELASTIC_"


def under_torchrun() -> bool:
    """Whether this process is a rank that a launcher started (``RANK`` and ``WORLD_SIZE`` set)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launcher_variables(env: dict[str, str] | os._Environ) -> list[str]:
    """The names in ``env`` that a launcher set for its ranks."""
    return [k for k in env if k in RANK_VARIABLES or k.startswith(AGENT_PREFIX)]


def without_launcher(env: dict[str, str] | os._Environ | None = None) -> dict[str, str]:
    """A copy of ``env`` (default: this process's) without a launcher's variables: the
    environment of a process that starts ranks of its own ([Note: launcher variables])."""
    env = dict(os.environ if env is None else env)
    for name in launcher_variables(env):
        del env[name]
    return env


def forget_launcher() -> None:
    """Remove a launcher's agent variables from this process's environment (a rank we start
    sets its own ``RANK``, ``MASTER_PORT``, ...; nothing may point it at an agent's store)."""
    for name in [k for k in os.environ if k.startswith(AGENT_PREFIX)]:
        del os.environ[name]

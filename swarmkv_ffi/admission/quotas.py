"""What one user may take of a shared daemon.

The daemon's own user (its operator) is not limited. Every other uid may hold at most
`clients` connections, `agents` agents, `ledger_share` of the device budget (its agents'
contexts plus the weights of every model they use) and `swap_share` of the host RAM
kept for paused agents. The defaults leave any one user at most half of each budget and
an eighth of the connections, so one user cannot shut the others out.
"""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_CLIENTS_PER_UID = 32
DEFAULT_AGENTS_PER_UID = 64
DEFAULT_SHARE_PERCENT = 50.0


@dataclass(frozen=True)
class Quotas:
    clients: int = DEFAULT_CLIENTS_PER_UID
    agents: int = DEFAULT_AGENTS_PER_UID
    ledger_share: float = DEFAULT_SHARE_PERCENT / 100
    swap_share: float = DEFAULT_SHARE_PERCENT / 100

    def __post_init__(self):
        if self.clients < 1 or self.agents < 1:
            raise ValueError("--max-clients-per-uid and --max-agents-per-uid must be >= 1")
        if not (0 < self.ledger_share <= 1 and 0 < self.swap_share <= 1):
            raise ValueError("--uid-ledger-percent and --uid-swap-percent must be in (0, 100]")


UNLIMITED = Quotas(clients=1 << 30, agents=1 << 30, ledger_share=1.0, swap_share=1.0)

"""The one way a peer id is abbreviated, in logs, dashboards, ``monitor`` and ``status`` alike.

libp2p ids share their first characters (``Qm...`` or ``12D3KooW...``), so the distinguishing part is the tail:
``short_id`` keeps the last ``SHORT_ID_CHARS`` characters after an ellipsis. Grepping a log for what a dashboard shows
therefore finds the peer.
"""

from __future__ import annotations

SHORT_ID_CHARS = 8


def short_id(peer_id: str, n: int = SHORT_ID_CHARS + 1) -> str:
    """``'12D3KooWAbc...wxyz'`` -> ``'…stuvwxyz'`` (``n`` characters in all, the ellipsis included); '' -> '?'."""
    if not peer_id:
        return "?"
    if len(peer_id) <= n:
        return peer_id
    return "…" + peer_id[-(n - 1):]

"""What each defence did to the samples a node received: per-sample statistics of the loss, the
per-round defence counters of `metrics.jsonl`, and the opt-in per-received-sample log.

A node's defences, in the order a sample meets them: the parser (`exchange.unpack` drops a
malformed record, `Drop.kind` says why), `verify_rewards` (a rescored reward that differs from the
claim), then the loss: the truncation of the IS weight at C and the filter (the advantage of an
off-policy sample set to 0). The op reports the filter per sample but counts as "filtered" a
sample whose advantage was 0 already; `changed` is a filtered sample with a non-zero advantage,
the ones the filter acted on.

`received.jsonl` (`sample_log: true`, written by node 0) has one line per received record and
receiving node: round, receiver, sender, peer (the sender's transport id: its rank as text under
torch, a peer id under hivemind; null for a drop no known peer signed), prompt_id, n_tokens,
reward, advantage, kl (the loss's
per-sample KL, in its `kl_reduction`), filtered, changed, truncated (the share of the sample's
tokens whose IS weight the cap truncated) and dropped (null; for a record a defence dropped, the
`Drop` kind, with `reason`, and null statistics) and staleness (the rounds between the sample's
generation and its use: always 0 under torch's lockstep; null for a dropped record).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch

from ftis_kernels.grpo.exchange import DROP_KINDS, Drop, Sample

SAMPLE_LOG = "received.jsonl"
# The per-round counters `defence_metrics` returns, in metrics.jsonl's order.
DEFENCE_KEYS = (
    "recv_kl_mean",
    "recv_truncated_frac",
    "filter_changed_frac",
    "filter_changed_neg",
    *(f"dropped_{kind}" for kind in DROP_KINDS),
)


def sample_stats(metrics: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    """Per sample of one `ftis_loss` call, from its metrics: kl, filtered (0/1) and truncated (the
    op's `is_truncated`: the share of the sample's completion tokens whose IS weight the cap
    truncated, 0 unless is_mode is "tis"). Padded or packed, one value per sample."""
    return dict(
        kl=metrics["kl"].float().tolist(),
        filtered=metrics["filtered"].float().tolist(),
        truncated=metrics["is_truncated"].float().tolist(),
    )


def defence_metrics(
    own: Sequence[Sample],
    received: Sequence[Sample],
    per_sample: dict[str, list[float]],
    drops: Sequence[Drop],
) -> dict[str, float]:
    """The round's defence counters of a node that trained on `own` + `received` (in that order,
    `per_sample` from `grpo_update`) and dropped `drops`:

    recv_kl_mean, recv_truncated_frac: the received samples' mean KL and the share of their tokens
    whose IS weight was truncated (NaN without received samples); filter_changed_frac: the share
    of all trained samples whose advantage the filter set to 0 from non-zero; filter_changed_neg:
    that share among received samples with a negative advantage (NaN without any);
    dropped_<kind>: the records dropped by the parser (per `Drop.kind`) or by `verify_rewards`.
    """
    samples = [*own, *received]
    changed = [f > 0 and s.advantage != 0 for s, f in zip(samples, per_sample["filtered"])]
    mine = len(own)
    recv_kl = per_sample["kl"][mine:]
    recv_tokens = [s.n_tokens for s in received]
    negative = [c for s, c in zip(received, changed[mine:]) if s.advantage < 0]
    out = dict(
        recv_kl_mean=sum(recv_kl) / len(recv_kl) if recv_kl else math.nan,
        recv_truncated_frac=(
            sum(t * n for t, n in zip(per_sample["truncated"][mine:], recv_tokens))
            / sum(recv_tokens)
            if received
            else math.nan
        ),
        filter_changed_frac=sum(changed) / len(samples),
        filter_changed_neg=sum(negative) / len(negative) if negative else math.nan,
    )
    kinds = [d.kind for d in drops]
    out.update({f"dropped_{kind}": float(kinds.count(kind)) for kind in DROP_KINDS})
    return out


def sample_rows(
    round_: int,
    receiver: int,
    own: Sequence[Sample],
    received: Sequence[Sample],
    per_sample: dict[str, list[float]],
    drops: Sequence[Drop],
) -> list[dict[str, Any]]:
    """The `received.jsonl` lines of one node's round: its received samples, then its drops."""
    rows = []
    for i, s in enumerate(received, start=len(own)):
        filtered = per_sample["filtered"][i] > 0
        rows.append(
            dict(
                round=round_,
                receiver=receiver,
                sender=s.source,
                peer=s.peer,
                prompt_id=s.prompt_id,
                n_tokens=s.n_tokens,
                reward=s.reward,
                advantage=s.advantage,
                kl=per_sample["kl"][i],
                filtered=filtered,
                changed=filtered and s.advantage != 0,
                truncated=per_sample["truncated"][i],
                dropped=None,
                staleness=s.staleness,
            )
        )
    for d in drops:
        rows.append(
            dict(
                round=round_,
                receiver=receiver,
                sender=d.sender,
                peer=d.peer or None,
                prompt_id=None,
                n_tokens=None,
                reward=None,
                advantage=None,
                kl=None,
                filtered=None,
                changed=None,
                truncated=None,
                dropped=d.kind,
                reason=str(d),
                staleness=None,
            )
        )
    return rows


def start_sample_log(path: Path, start: Optional[int]) -> None:
    """A fresh `received.jsonl` (start None), or a resumed run's, cut to the rounds before
    `start` (a torn last line is dropped)."""
    kept = []
    if start is not None and path.exists():
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("round"), int) and row["round"] < start:
                kept.append(line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


def append_sample_log(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.writelines(json_line(r) for r in rows)


def json_line(row: dict[str, Any]) -> str:
    """`row` as one line of strict JSON: a non-finite float (the loss of a skipped step, say) is
    null, since `Infinity` and `NaN` are no JSON and many readers refuse them."""
    clean = {
        k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()
    }
    return json.dumps(clean, allow_nan=False) + "\n"

"""What signed pipeline frames cost (peer/pipeline/attest.py): per frame, the CPU time to sign and to check a frame and
the bytes the signature adds; per middle-stage re-check, the bytes of a testimony.

For each run, one micro-batch's forward to a stage from 2 on and the gradient back are built at the run's shapes and
codecs, signed with the key the daemon uses (RSA-2048, e = 65537, the identity hivemind creates; ``--key ed25519``:
the alternative), and timed over ``--repeat`` rounds (median). The signing stage pays digest + signature per frame it
sends on and per gradient it returns; the receiver pays digest + verification; the stage that re-checks pays a
testimony's two frames on the wire and ``judge`` (two digests, four verifications). ``unsigned_testimony_bytes`` is
what the earlier unsigned testimony carried (2 rows of activations and gradient, fp32).

    python tools/bench_attest.py --json docs/bench/attest_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from cryptography.hazmat.primitives.asymmetric import rsa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peer.membership import signing  # noqa: E402
from peer.membership.signing import Signer  # noqa: E402
from peer.pipeline import attest  # noqa: E402
from peer.pipeline.attest import KeyNotary  # noqa: E402
from peer.pipeline.boundary import Boundary  # noqa: E402
from protocol.messages import Backward, Forward, pack  # noqa: E402
from trainer.config import RunConfig  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RUNS = ["tests/runs/tiny3.toml", "trainer/runs/default.toml", "trainer/runs/llama-1b.toml"]
ROWS = 2  # rows a re-check asks of a testimony (RecheckConfig.rows)


def _median_ms(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        signing._verified.clear()  # every check verifies anew (a peer remembers what it verified, a frame is new)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(1000 * statistics.median(times), 4)


def _signer(kind: str) -> Signer:
    if kind == "ed25519":
        return Signer.generate()
    return Signer(rsa.generate_private_key(public_exponent=65537, key_size=2048))


def measure(run: RunConfig, kind: str, repeat: int) -> dict[str, object]:
    b, t, d = run.data.batch_size, run.model.block_size, run.model.n_embd
    hop, witness = _signer(kind), _signer(kind)
    nh, nw = KeyNotary(hop), KeyNotary(witness)
    boundary = Boundary(run, None)
    x, ids = torch.randn(b, t, d), torch.randint(0, run.model.vocab_size, (b, t))
    targets, window = boundary.first_hop(ids, ids)
    acts, tokens = boundary.encode_forward(x, window)
    route = ["Q" * 52, hop.peer_id]
    fwd = Forward(run_id=run.run_id, mb_id=2**40, route=route, activations=acts, targets=targets, is_eval=False,
                  sent_at=time.time(), tokens=tokens)
    bwd = Backward(run_id=run.run_id, mb_id=2**40, route=route, gradient=boundary.encode_gradient(x), loss=3.0,
                   is_eval=False)
    signed_fwd, answers = attest.signed_frame(nh, fwd, hop.peer_id)
    signed_bwd = attest.sign(nw, bwd, witness.peer_id, hop.peer_id, answers)
    digest = attest.signed_by(nh, signed_bwd, witness.peer_id, hop.peer_id, answers)
    assert digest is not None
    relayed = attest.relay(signed_bwd, digest, answers)
    testimony = attest.testify(nw, witness.peer_id, hop.peer_id, signed_fwd, signed_bwd)
    judged = attest.judge(nh, testimony, run_id=run.run_id, hop=hop.peer_id, witness=witness.peer_id, mb_id=2**40,
                          relayed=relayed)
    assert judged.verdict is attest.Verdict.OK
    return {
        "run": run.name if hasattr(run, "name") else run.run_id, "key": kind,
        "forward_bytes": len(pack(fwd)), "gradient_bytes": len(pack(bwd)),
        "signature_bytes_forward": len(pack(signed_fwd)) - len(pack(fwd)),
        "signature_bytes_gradient": len(pack(signed_bwd)) - len(pack(bwd)),
        "relayed_bytes_per_witness": sum(len(v) for v in relayed) + 6,
        "testimony_bytes": len(pack(testimony)),
        "unsigned_testimony_bytes": 2 * ROWS * t * d * 4,
        "digest_ms_forward": _median_ms(lambda: attest.digest(fwd), repeat),
        "sign_ms_forward": _median_ms(lambda: attest.sign(nh, fwd, hop.peer_id), repeat),
        "check_ms_forward": _median_ms(lambda: attest.signed_by(nw, signed_fwd, hop.peer_id), repeat),
        "sign_ms_gradient": _median_ms(lambda: attest.sign(nw, bwd, witness.peer_id, hop.peer_id, answers), repeat),
        "testify_ms": _median_ms(lambda: attest.testify(nw, witness.peer_id, hop.peer_id, signed_fwd, signed_bwd),
                                 repeat),
        "judge_ms": _median_ms(lambda: attest.judge(nh, testimony, run_id=run.run_id, hop=hop.peer_id,
                                                    witness=witness.peer_id, mb_id=2**40, relayed=relayed), repeat),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default=",".join(RUNS), help="comma-separated run files (relative to the repository)")
    ap.add_argument("--key", choices=["rsa", "ed25519"], default="rsa")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    load0 = os.getloadavg()[0]
    rows = []
    for path in args.runs.split(","):
        run = RunConfig.from_toml(ROOT / path)
        row = measure(run, args.key, args.repeat)
        row["run"] = path
        rows.append(row)
        print(json.dumps(row))
    out = {"command": "python tools/bench_attest.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "machine": {"cores": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
                       "load_average_start": round(load0, 2), "load_average_end": round(os.getloadavg()[0], 2)},
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": rows}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

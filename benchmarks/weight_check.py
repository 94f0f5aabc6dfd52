"""What the weight-sync sentinel (``--check-weights``, ``slimecore.weight_check``) adds to a training step.

    python benchmarks/weight_check.py --model smollm2 --repeats 7
    python benchmarks/weight_check.py --model tiny --repeats 7

One embedded engine in this process (HTTP, the real endpoints), the model's weights as the fsdp trainer holds
them (in shared memory, ``weight_sync.share_weights``), pushed over the tensor transport (the CPU default) as
rank 0 pushes them. Alternated per round:

- ``push``: the push alone; ``push_with_checksums``: the push taking the checksums of each bucket while the
  engine loads it (what rank 0 does with the check on);
- ``engine_check``: ``POST /weights_checker`` on the engine and the comparison (what the rollout manager does
  before the engines resume), all tensors;
- ``trainer_checksums_alone``: rank 0's checksums without the overlap (the object-store and disk transports).

The added time of a checked sync is ``push_with_checksums - push + engine_check`` (medians of ``--repeats``
rounds after one left out), set against the step time of the latest ``benchmarks/results/vs_trl_<model>_*.json``
on this machine (same work as the vs-TRL comparison).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="smollm2")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=None, help="default: benchmarks/results/weight_check_<model>.json")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    from slimecore import weight_check
    from slimecore.engines import weight_sync
    from slimecore.engines.launch import Endpoint
    from slimecore.testing.engines import embedded_engine
    from slimecore.trainers.weight_sender import WeightSender

    if args.model == "smollm2":
        from slimecore.hf_checkpoint import resolve_checkpoint

        checkpoint = resolve_checkpoint(None)
    else:
        from slimecore.testing.tiny import make_tiny_checkpoint

        checkpoint = make_tiny_checkpoint(Path(tempfile.gettempdir()) / "slimecore-bench-tiny")
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    weight_sync.share_weights(model)  # as the fsdp trainer keeps them on CPU
    named = list(weight_sync.unique_tensors(model.state_dict().items()))
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    sender = WeightSender(timeout=600)
    rounds: dict[str, list[float]] = {k: [] for k in ("push", "push_with_checksums", "engine_check",
                                                       "trainer_checksums_alone")}
    with embedded_engine(checkpoint) as server:
        endpoint = Endpoint(server.url)
        for round_ in range(args.repeats + 1):
            for key in rounds:
                start = time.perf_counter()
                if key == "push":
                    sender.push(weight_sync.bucketize(named, sender.bucket_bytes), [endpoint], str(round_), "tensor")
                elif key == "push_with_checksums":
                    expected = sender.push(weight_sync.bucketize(named, sender.bucket_bytes), [endpoint], str(round_),
                                           "tensor", checksum="all")["checksums"]
                elif key == "engine_check":
                    compared = weight_check.check_engines(expected, [server.url], str(round_), every_name=True)
                else:
                    weight_check.checksums(named)
                if round_:  # the first round pays for page faults and imports
                    rounds[key].append(time.perf_counter() - start)
    medians = {k: statistics.median(v) for k, v in rounds.items()}
    added = medians["push_with_checksums"] - medians["push"] + medians["engine_check"]
    steps = sorted(Path("benchmarks/results").glob(f"vs_trl_{args.model}_*.json"))
    step_file = next((p for p in reversed(steps) if "slime-core" in json.loads(p.read_text()).get("summary", {})), None)
    step = json.loads(step_file.read_text())["summary"]["slime-core"]["median_step"] if step_file else None
    result = {
        "model": args.model, "checkpoint": str(checkpoint), "weight_bytes": nbytes, "tensors_compared": compared,
        "repeats": args.repeats, "median_s": medians, "all_s": rounds,
        "added_per_checked_sync_s": added,
        "step_s": step, "step_source": str(step_file) if step_file else None,
        "added_share_of_step": added / step if step else None,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "torch": torch.__version__, "load_average_at_end": list(os.getloadavg()),
    }
    out = Path(args.out or f"benchmarks/results/weight_check_{args.model}.json")
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("model", "median_s", "added_per_checked_sync_s", "step_s",
                                             "added_share_of_step")}, indent=1))


if __name__ == "__main__":
    main()

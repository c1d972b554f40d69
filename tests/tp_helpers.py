"""Probes installed in each tensor-parallel rank (module-level functions, so that they pickle into the
worker processes): what each rank committed, and a rank-dependent perturbation of its logits."""
from __future__ import annotations


def install_probe(worker) -> None:
    """Records the tokens this rank commits per sampled sequence, and (when switched on) adds a large
    rank-dependent bonus to one token of its logits, so ranks > 0 would pick other tokens than rank 0."""
    runner = worker.runner
    runner.probe_log = []
    runner.probe_perturb = False
    real_logits, real_record = runner.model.compute_logits, runner.seqs.record

    def compute_logits(hidden):
        logits = real_logits(hidden)
        if runner.probe_perturb and runner.rank > 0:
            logits[:, (37 * runner.rank) % logits.shape[1]] += 1e4
        return logits

    def record(b, prep, tokens, accepted):
        for s, i in enumerate(b.spec.batch_index):
            n = int(accepted[s])
            runner.probe_log.append((int(b.seqs.seq_ids[i]), [int(t) for t in tokens[s, :n + 1]]))
        real_record(b, prep, tokens, accepted)

    runner.model.compute_logits = compute_logits
    runner.seqs.record = record


def set_probe(worker, perturb: bool, share: bool) -> None:
    worker.runner.probe_perturb = perturb
    worker.runner.share_decisions = share
    worker.runner.probe_log = []


def probe_log(worker) -> list[tuple[int, list[int]]]:
    return list(worker.runner.probe_log)

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

    def record(b, prep, tokens, accepted, *rest):
        for s, i in enumerate(b.spec.batch_index):
            n = int(accepted[s])
            runner.probe_log.append((int(b.seqs.seq_ids[i]), [int(t) for t in tokens[s, :n + 1]]))
        real_record(b, prep, tokens, accepted, *rest)

    runner.model.compute_logits = compute_logits
    runner.seqs.record = record


def set_probe(worker, perturb: bool, share: bool) -> None:
    worker.runner.probe_perturb = perturb
    worker.runner.share_decisions = share
    worker.runner.probe_log = []


def probe_log(worker) -> list[tuple[int, list[int]]]:
    return list(worker.runner.probe_log)


class RankDependentProposer:
    """A device proposer whose drafts differ by rank (rank 0's are the plain guess from this forward's
    final hidden state, rank r's are shifted by r): only the broadcast of rank 0's drafts keeps the
    ranks verifying the same tokens."""

    on_device = True
    hidden_layers = (0,)

    def propose(self, inp, k):
        import torch
        import torch.distributed as dist

        from namazu.spec.proposer import Proposal

        rank = dist.get_rank() if dist.is_initialized() else 0
        vocab = 264
        last = inp.rows.gather(1, inp.accepted.unsqueeze(-1)).squeeze(-1)
        guess = (inp.final_hidden[last].abs().argmax(-1) + inp.tokens[:, 0] + rank) % vocab
        ids = torch.stack([(guess + j * (1 + rank)) % vocab for j in range(k)], dim=1)
        return Proposal(ids, counts=torch.full_like(guess, k))


def perturb_trees(worker, on: bool) -> None:
    """Ranks > 0 shift every draft node of the trees their drafter proposes (rank 0's stay): only the
    broadcast of rank 0's trees keeps the ranks' verify forwards over the same tokens."""
    spec = worker.runner.spec
    proposer = spec.proposer
    real = getattr(proposer, "_real_propose_tree", None) or proposer.propose_tree
    proposer._real_propose_tree = real
    if not on or worker.runner.rank == 0:
        proposer.propose_tree = real
        return

    def propose_tree(inp, tt):
        tree = real(inp, tt)
        tokens = tree.tokens.clone()
        tokens[:, 1:] = (tokens[:, 1:] + 11 * worker.runner.rank) % worker.runner.model_config.vocab_size
        return tree._replace(tokens=tokens)

    proposer.propose_tree = propose_tree

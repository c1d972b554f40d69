"""A MODEL of a 3-replica fleet behind a routing policy: where each policy saturates, and TTFT and prompt
blocks computed at round-robin's saturation point. It complements `bench/router.py` (the real fleet over
HTTP); it does not replace it. What it leaves out: HTTP, tokenizing and streaming overheads, replicas
sharing CPU cores, the router's poll lag (it sees each replica's state exactly), preemption, chunked
prefill.

The replicas run like namazu's engine: first come, first served, up to `max_seqs` sequences at once; an
iteration costs a fixed step plus the prompt blocks it prefills, and each prefilled block stays cached
(chained hashes: a prompt's leading blocks). The workload is `bench/router.py`'s: users share a few long
system prompts and hold multi-turn conversations, turns in a random user order at Poisson arrival times,
a user's turn k+1 sent only once turn k's answer is complete. The router sees what the HTTP router sees:
each replica's cached prefix of the prompt, its active blocks, the requests without a first token there
and their blocks, the steps left of the sequences in its slots; and the replica's rates (the model's
own: the real router measures them, `server/router/load_model.py`).

    python bench/router_capacity.py                         # sweep, table, bench/router_capacity.png
    python bench/router_capacity.py --rates 60:120:5 --seeds 3 --policies round_robin,kv,affinity
    python bench/router_capacity.py --system-blocks 96 --rates 80:110:5 --policies round_robin,kv
"""
from __future__ import annotations

import argparse
import heapq
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from server.router.load_model import Pending, Rates
from server.router.policy import ReplicaView, make_policy, queued_estimate

HERE = Path(__file__).resolve().parent
SUSTAINED = 0.95      # as in bench/router.py: a rate is sustained when requests finish at >= 95% of it


@dataclass(frozen=True)
class FleetModel:
    replicas: int = 3
    max_seqs: int = 4          # --max-num-seqs
    step_ms: float = 5.0       # one engine iteration (a decode step of the batch)
    prefill_ms: float = 2.0    # per prompt block computed in an iteration
    output: int = 16           # decode iterations per request

    @property
    def rates(self) -> Rates:
        return Rates(ms_per_block=self.prefill_ms, ms_per_step=self.step_ms, overhead_ms=self.step_ms)


@dataclass(frozen=True)
class Workload:
    users: int = 150
    turns: int = 4
    systems: int = 4           # distinct system prompts, user u has system u % systems
    system_blocks: int = 24
    question_blocks: int = 2   # the new question of a turn
    answer_blocks: int = 1     # the previous answer, part of the next turn's prompt


@dataclass
class Req:
    rid: int
    user: int
    hashes: list
    scheduled: float                # Poisson arrival time (ms)
    arrival: float = -1.0           # when it was sent: scheduled, or when the user's previous turn ended
    uncached_at_routing: int = 0
    started: float = -1.0           # first token: the end of its prefill iteration
    finished: float = -1.0
    left: int = 0
    prev: Req | None = None         # the user's previous turn


@dataclass
class SimReplica:
    name: str
    model: FleetModel
    cache: set = field(default_factory=set)        # block hashes prefilled here
    promised: set = field(default_factory=set)     # routed here, not prefilled yet (the router's history)
    waiting: list = field(default_factory=list)
    running: list = field(default_factory=list)
    computed: int = 0                              # prompt blocks prefilled
    max_queue: int = 0
    busy: bool = False

    def cached_prefix(self, hashes: list) -> int:
        n = 0
        for h in hashes:
            if h not in self.cache and h not in self.promised:
                break
            n += 1
        return n

    def queued(self) -> int:
        """Requests that will wait for a slot (those beyond the free ones), as the router estimates it."""
        in_flight = len(self.waiting) + len(self.running)
        return queued_estimate(in_flight, self.model.max_seqs, 0)

    def view(self, hashes: list, now: float) -> ReplicaView:
        """What the router sees: the replica's exact state, and its rates as the model sets them (the real
        router measures them; `server.router.load_model`)."""
        active = len({h for r in self.running for h in r.hashes})
        # Admitted in the iteration under way: in their prefill, no first token yet.
        prefilling = [r for r in self.running if r.started > now]
        pending = tuple(Pending(r.uncached_at_routing, len(r.hashes), self.model.output)
                        for r in prefilling + self.waiting)
        running = tuple(float(r.left) for r in self.running if r.started <= now)
        return ReplicaView(self.name, self.cached_prefix(hashes), float(active), float(self.queued()),
                           len(self.waiting) + len(self.running), pending, running, self.model.max_seqs,
                           self.model.rates)

    def iterate(self, now: float) -> tuple[float, list[Req]]:
        """Admits waiting requests into free slots, runs one iteration; returns its end and the requests
        it finished."""
        prefill = 0
        admitted = []
        while self.waiting and len(self.running) < self.model.max_seqs:
            r = self.waiting.pop(0)
            prefill += sum(1 for h in r.hashes if h not in self.cache)
            self.cache.update(r.hashes)
            admitted.append(r)
            self.running.append(r)
        self.computed += prefill
        end = now + self.model.step_ms + self.model.prefill_ms * prefill
        for r in admitted:
            r.started = end
        for r in self.running:
            r.left -= 1
        done = [r for r in self.running if r.left <= 0]
        self.running = [r for r in self.running if r.left > 0]
        for r in done:
            r.finished = end
        return end, done


def conversation_turns(rate: float, work: Workload, seed: int) -> list[Req]:
    """The turns in sending order: user order a random permutation (each user exactly `turns` times),
    scheduled at Poisson times; turn k of a user is its system prompt, its k earlier questions and
    answers, and a new question."""
    rng = random.Random(seed)
    order = [u for u in range(work.users) for _ in range(work.turns)]
    rng.shuffle(order)
    t, turn, out = 0.0, [0] * work.users, []
    per_turn = work.question_blocks + work.answer_blocks
    for i, u in enumerate(order):
        t += rng.expovariate(rate) * 1000.0
        k = turn[u]
        turn[u] += 1
        s = u % work.systems
        hashes = ([("sys", s, j) for j in range(work.system_blocks)]
                  + [("user", u, j) for j in range(per_turn * k + work.question_blocks)])
        out.append(Req(i, u, hashes, t))
    return out


def simulate(policy, rate: float, model: FleetModel = FleetModel(), work: Workload = Workload(),
             seed: int = 0) -> dict:
    """Runs the workload at `rate` req/s through `policy`; TTFT (ms) percentiles, prompt blocks computed,
    the longest queue, and the rate requests were sent and finished at."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 req/s, got {rate}")
    replicas = [SimReplica(f"r{i}", model) for i in range(model.replicas)]
    by_name = {r.name: r for r in replicas}
    reqs = conversation_turns(rate, work, seed)
    events: list = []        # (time, order, kind, payload)
    order = 0

    def push(t: float, kind: str, payload) -> None:
        nonlocal order
        heapq.heappush(events, (t, order, kind, payload))
        order += 1

    previous: dict[int, Req] = {}
    after: dict[int, Req] = {}            # rid -> the user's next turn, due but waiting for this one's answer
    for r in reqs:
        r.left = model.output
        r.prev = previous.get(r.user)
        previous[r.user] = r
        push(r.scheduled, "due", r)
    while events:
        now, _, kind, payload = heapq.heappop(events)
        touched: SimReplica | None = None
        if kind == "due":
            r = payload
            if r.prev is not None and r.prev.finished < 0:
                after[r.prev.rid] = r
                continue
            r.arrival = now
            views = [rep.view(r.hashes, now) for rep in replicas]
            touched = by_name[policy.choose(views, len(r.hashes), model.output).replica]
            r.uncached_at_routing = len(r.hashes) - touched.cached_prefix(r.hashes)
            touched.promised.update(r.hashes)
            touched.waiting.append(r)
            touched.max_queue = max(touched.max_queue, touched.queued())
        else:
            touched = by_name[payload[0]]
            touched.busy = False
            for d in payload[1]:
                nxt = after.pop(d.rid, None)
                if nxt is not None:
                    push(now, "due", nxt)
        touched.promised -= touched.cache
        if not touched.busy and (touched.waiting or touched.running):
            touched.busy = True
            end, done = touched.iterate(now)
            push(end, "iter", (touched.name, done))
    if any(r.finished < 0 for r in reqs):
        raise RuntimeError("the simulation ended with requests unfinished")
    ttft = np.array([r.started - r.arrival for r in reqs])
    last_sent = max(r.arrival for r in reqs)
    last_done = max(r.finished for r in reqs)
    return {"policy": policy.name, "rate": rate, "computed": sum(r.computed for r in replicas),
            "ttft_p50": float(np.percentile(ttft, 50)), "ttft_p99": float(np.percentile(ttft, 99)),
            "max_queue": max(r.max_queue for r in replicas),
            "offered": len(reqs) / (reqs[-1].scheduled / 1000.0),
            # finished at: requests / the time the last one finished (a fleet that falls behind ends late)
            "done_per_s": len(reqs) / (last_done / 1000.0), "sent_per_s": len(reqs) / (last_sent / 1000.0),
            "requests": reqs}


def sustained(point: dict) -> bool:
    return point["done_per_s"] >= SUSTAINED * point["offered"]


def sweep(policies: list[str], rates: list[float], seeds: int, model: FleetModel = FleetModel(),
          work: Workload = Workload()) -> list[dict]:
    """Every (policy, rate), each the mean over `seeds` workloads (the same workloads for every policy);
    `sustained` only if every seed kept up."""
    out = []
    for name in policies:
        for rate in rates:
            runs = [simulate(make_policy(name, seed=s), rate, model, work, seed=s) for s in range(seeds)]
            point = {k: float(np.mean([r[k] for r in runs])) for k in ("computed", "ttft_p50", "ttft_p99",
                                                                       "offered", "done_per_s")}
            point.update(policy=name, rate=rate, max_queue=max(r["max_queue"] for r in runs),
                         kept_up=all(sustained(r) for r in runs))
            out.append(point)
    return out


def highest_sustained(points: list[dict], policy: str) -> float | None:
    """The highest rate below which every rate of the sweep was sustained (a sweep that keeps up again
    above a failure, by noise, does not count)."""
    best = None
    for p in sorted((p for p in points if p["policy"] == policy), key=lambda p: p["rate"]):
        if not p["kept_up"]:
            break
        best = p["rate"]
    return best


def report(points: list[dict]) -> list[str]:
    policies = list(dict.fromkeys(p["policy"] for p in points))
    lines = ["| policy | rate req/s | TTFT p50 ms | TTFT p99 ms | prompt blocks computed | max queue | "
             "req/s done | kept up |", "|---|---|---|---|---|---|---|---|"]
    for p in points:
        lines.append(f"| {p['policy']} | {p['rate']:g} | {p['ttft_p50']:.0f} | {p['ttft_p99']:.0f} | "
                     f"{p['computed']:.0f} | {p['max_queue']} | {p['done_per_s']:.1f} | {p['kept_up']} |")
    lines.append("")
    caps = {name: highest_sustained(points, name) for name in policies}
    for name, cap in caps.items():
        lines.append(f"- {name}: highest rate sustained {cap if cap is not None else 'none'}")
    at = {p["policy"]: p for p in points if p["rate"] == caps.get("round_robin")}
    rr = at.get("round_robin")
    for name, p in at.items():
        if rr is not None and name != "round_robin":
            lines.append(f"- at round-robin's highest sustained rate ({rr['rate']:g} req/s), {name}: prompt blocks "
                         f"{p['computed'] / rr['computed']:.2f}x round-robin's; TTFT p50 {p['ttft_p50']:.0f} ms "
                         f"against {rr['ttft_p50']:.0f}, p99 {p['ttft_p99']:.0f} ms against {rr['ttft_p99']:.0f} "
                         f"(round-robin / {name}: {rr['ttft_p99'] / p['ttft_p99']:.2f}x)")
    return lines


def plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for i, name in enumerate(dict.fromkeys(p["policy"] for p in points)):
        mine = sorted((p for p in points if p["policy"] == name), key=lambda p: p["rate"])
        x = [p["rate"] for p in mine]
        axes[0].plot(x, [p["ttft_p99"] for p in mine], "o-", color=f"C{i}", label=f"{name} p99")
        axes[0].plot(x, [p["ttft_p50"] for p in mine], "s:", color=f"C{i}", label=f"{name} p50")
        axes[1].plot(x, [p["computed"] for p in mine], "o-", color=f"C{i}", label=name)
        axes[2].plot([p["offered"] for p in mine], [p["done_per_s"] for p in mine], "o-", color=f"C{i}", label=name)
    hi = max(p["offered"] for p in points)
    axes[2].plot([0, hi], [0, hi], "k:", lw=0.8, label="offered")
    axes[0].set(title="TTFT (model)", xlabel="req/s offered", ylabel="ms", yscale="log")
    axes[1].set(title="prompt blocks computed (model)", xlabel="req/s offered")
    axes[2].set(title="done vs offered (model)", xlabel="req/s offered", ylabel="req/s done")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("simulated 3-replica fleet (bench/router_capacity.py): a model, not a measurement")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def parse_rates(text: str) -> list[float]:
    """'60,70,80' or 'start:stop:step' (stop included)."""
    if ":" in text:
        start, stop, step = (float(x) for x in text.split(":"))
        if step <= 0 or stop < start:
            raise ValueError("want start:stop:step with step > 0 and stop >= start")
        return [round(start + i * step, 6) for i in range(int(round((stop - start) / step)) + 1)]
    return [float(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", default="round_robin,kv,affinity")
    p.add_argument("--rates", default="50:110:5", help="offered req/s: a list, or start:stop:step")
    p.add_argument("--seeds", type=int, default=3, help="workloads per point (the same for every policy)")
    p.add_argument("--users", type=int, default=Workload.users)
    p.add_argument("--turns", type=int, default=Workload.turns)
    p.add_argument("--system-blocks", type=int, default=Workload.system_blocks,
                   help="blocks of each shared system prompt (96: bench/router.py's --system-len 1536)")
    p.add_argument("--max-seqs", type=int, default=FleetModel.max_seqs)
    p.add_argument("--plot", default=str(HERE / "router_capacity.png"))
    args = p.parse_args(argv)
    try:
        rates = parse_rates(args.rates)
    except ValueError as e:
        raise SystemExit(f"--rates {args.rates!r}: {e}") from None
    if not rates or any(not r > 0 for r in rates):
        raise SystemExit("--rates must all be > 0")
    if min(args.seeds, args.users, args.turns, args.max_seqs, args.system_blocks) < 1:
        raise SystemExit("--seeds, --users, --turns, --system-blocks and --max-seqs must be >= 1")
    points = sweep(args.policies.split(","), rates, args.seeds, FleetModel(max_seqs=args.max_seqs),
                   Workload(users=args.users, turns=args.turns, system_blocks=args.system_blocks))
    print("\n".join(report(points)))
    plot(points, Path(args.plot))
    print(f"\nwrote {args.plot}")


if __name__ == "__main__":
    main()

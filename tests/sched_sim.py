"""Reference model of ZipMoE's cache-affinity scheduling (paper §3.3, Appendices A and B), for tests.

The model (the one ggml-zipmoe-policy.h documents for ggml_zipmoe_schedule): a task is one expert
tensor in a compression state; one I/O thread reads chunks back to back (SM-chunk: u, E-chunk: rho*u/K);
L identical workers decompress shards (c each; shard s needs E-chunk s in memory); a task is done
when its SM-chunk is in memory and its K shards are decompressed, an expert when all its tasks
are; one execution stream runs the done experts one at a time (p each), earliest first; the
makespan is the end of the last execution.

- `simulate` executes a schedule: the reads in list order; the decompressions either as a
  priority list, work-conserving (how the runtime and ALG run; bit-for-bit the timing model of
  zipmoe-sched.c), or as a start order, each as early as possible (the semi-active schedules the
  optimum is searched among).
- `optimal` finds the optimal makespan exactly by branch and bound over
  (I/O order) x (decompression start order); see its docstring for why that space holds an
  optimal schedule. `brute_force` enumerates the same spaces without any reduction (tiny instances).
- `lower_bound` is Lemma B.3's max{I, C/L, P, Z}.
- `reference_schedule` is Algorithm 1 with the same reading as zipmoe-sched.c, to check the C
  function's output exactly.
"""
from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field

M, C, S, E, F = range(5)  # enum ggml_zipmoe_expert_state
STATE_NAMES = "MCSEF"


def reads_sm(state: int) -> bool:
    return state in (M, E)


def reads_e(state: int) -> bool:
    return state in (M, S)


def is_type_1(state: int) -> bool:
    return reads_sm(state)


@dataclass(frozen=True)
class Instance:
    tasks: tuple  # ((expert, state, p), ...)
    u: float
    rho: float
    c: float
    K: int
    L: int

    @property
    def n(self) -> int:
        return len(self.tasks)

    @property
    def t_e(self) -> float:
        return self.rho * self.u / self.K  # as zipmoe-sched.c rounds it

    @property
    def tol(self) -> float:
        return 1e-9 * self.n * ((1.0 + self.rho) * self.u + self.K * self.c)  # as zipmoe-sched.c

    def state(self, j: int) -> int:
        return self.tasks[j][1]

    def expert_p(self) -> dict:
        return {expert: p for expert, _, p in self.tasks}

    def reads(self) -> list:
        """Required reads (task, chunk): chunk 0 is the SM-chunk, 1 + s E-chunk s."""
        out = []
        for j, (_, state, _) in enumerate(self.tasks):
            if reads_e(state):
                out += [(j, 1 + s) for s in range(self.K)]
            if reads_sm(state):
                out.append((j, 0))
        return out

    def decompressions(self) -> list:
        return [(j, 1 + s) for j, (_, state, _) in enumerate(self.tasks) if state != F for s in range(self.K)]

    def describe(self) -> str:
        tasks = " ".join(f"{STATE_NAMES[st]}{ex}:{p:.3g}" for ex, st, p in self.tasks)
        return f"K={self.K} L={self.L} u={self.u:.3g} rho={self.rho:.3g} c={self.c:.3g} [{tasks}]"


@dataclass
class Threads:
    """What the I/O thread and the workers do with a (possibly partial) schedule."""
    io: list                 # (task, chunk, start, end)
    workers: list            # per worker: [(task, chunk, start, end)]
    arrival: dict            # (task, chunk) -> end of its read
    dec_end: dict            # (task, chunk) -> end of its decompression
    io_end: float
    idle: float              # total worker idle time before each worker's last decompression (eq. (2))
    worker_end: list         # workers' completion times, ascending (0 for an unused worker)


@dataclass
class Run(Threads):
    task_done: dict = field(default_factory=dict)
    expert_ready: dict = field(default_factory=dict)
    gpu: list = field(default_factory=list)   # (expert, start, end), in execution order
    makespan: float = 0.0


def run_threads(inst: Instance, io, dec, mode: str = "priority") -> Threads:
    """Execute reads io and decompressions dec (a priority list, or a start order when mode is "start")."""
    K, L, c = inst.K, inst.L, inst.c
    t = 0.0
    io_tl, arrival = [], {}
    for j, ch in io:
        start = t
        t += inst.u if ch == 0 else inst.t_e
        arrival[(j, ch)] = t
        io_tl.append((j, ch, start, t))
    io_end = t

    ready = [0.0 if not reads_e(inst.state(j)) else arrival[(j, ch)] for j, ch in dec]
    free = [0.0] * L
    workers = [[] for _ in range(L)]
    dec_end = {}
    idle = 0.0

    def run_on(w, d, now):
        nonlocal idle
        idle += now - free[w]
        free[w] = now + c
        j, ch = dec[d]
        workers[w].append((j, ch, now, free[w]))
        dec_end[(j, ch)] = free[w]

    if mode == "priority":
        # the same event loop as zipmoe_sched_simulate: releases in time order, the free worker
        # with the earliest end (lowest index on ties) takes the first released decompression
        position = {op: d for d, op in enumerate(dec)}
        release = [d for d, (j, _) in enumerate(dec) if not reads_e(inst.state(j))]
        release += [position[(j, ch)] for j, ch in io if ch > 0]
        nxt, heap = 0, []
        for _ in range(len(dec)):
            w = min(range(L), key=lambda l: (free[l], l))
            now = free[w]
            while nxt < len(release) and ready[release[nxt]] <= now:
                heapq.heappush(heap, release[nxt])
                nxt += 1
            if not heap:
                now = ready[release[nxt]]
                while nxt < len(release) and ready[release[nxt]] <= now:
                    heapq.heappush(heap, release[nxt])
                    nxt += 1
            run_on(w, heapq.heappop(heap), now)
    elif mode == "start":
        prev = 0.0
        for d in range(len(dec)):
            w = min(range(L), key=lambda l: (free[l], l))
            prev = max(ready[d], prev, free[w])
            run_on(w, d, prev)
    else:
        raise ValueError(mode)
    return Threads(io_tl, workers, arrival, dec_end, io_end, idle, sorted(free))


def gpu_makespan(ready: dict, p: dict) -> tuple:
    """Earliest-ready-first on one stream (optimal for 1|r_j|Cmax): (makespan, [(expert, start, end)])."""
    t, tl = 0.0, []
    for ex in sorted(ready, key=lambda e: (ready[e], e)):
        start = max(t, ready[ex])
        t = start + p[ex]
        tl.append((ex, start, t))
    return t, tl


def simulate(inst: Instance, io, dec, mode: str = "priority") -> Run:
    """Execute a complete schedule; checks that it holds every required operation exactly once."""
    if sorted(io) != sorted(inst.reads()) or len(set(io)) != len(io):
        raise ValueError("the reads are not the required ones, each once")
    if sorted(dec) != sorted(inst.decompressions()) or len(set(dec)) != len(dec):
        raise ValueError("the decompressions are not the required ones, each once")
    th = run_threads(inst, io, dec, mode)
    task_done = {}
    for j, (_, state, _) in enumerate(inst.tasks):
        done = th.arrival[(j, 0)] if reads_sm(state) else 0.0
        if state != F:
            done = max([done] + [th.dec_end[(j, 1 + s)] for s in range(inst.K)])
        task_done[j] = done
    expert_ready = {}
    for j, (ex, _, _) in enumerate(inst.tasks):
        expert_ready[ex] = max(expert_ready.get(ex, 0.0), task_done[j])
    makespan, gpu = gpu_makespan(expert_ready, inst.expert_p())
    return Run(**th.__dict__, task_done=task_done, expert_ready=expert_ready, gpu=gpu, makespan=makespan)


#
# Lemma B.3
#

def io_workload(inst: Instance, j: int) -> float:
    """v_j of Lemma B.3."""
    state = inst.state(j)
    return (inst.u if reads_sm(state) else 0.0) + (inst.rho * inst.u if reads_e(state) else 0.0)


def _decompress_alone(releases, L: int, c: float, free=None, prev: float = 0.0) -> float:
    """End of the last of these decompressions started in release order, each as early as possible
    (optimal for P|r_j, p_j = c|Cmax), on workers free at `free` after a start at `prev`."""
    free = sorted(free) if free is not None else [0.0] * L
    end = 0.0
    for r in sorted(releases):
        prev = max(r, prev, free[0])
        end = prev + c
        heapq.heapreplace(free, end)
    return end


def critical_path(inst: Instance, j: int) -> float:
    """z_j: the least time task j needs alone, its expert's execution included, with per-shard
    decompression (reading the E-chunks first, then the SM-chunk, is optimal alone)."""
    _, state, p = inst.tasks[j]
    if state == F:
        return p
    t_e = inst.rho * inst.u / inst.K
    rel = [k * t_e for k in range(1, inst.K + 1)] if reads_e(state) else [0.0] * inst.K
    sm = (inst.K * t_e if reads_e(state) else 0.0) + inst.u if reads_sm(state) else 0.0
    return max(sm, _decompress_alone(rel, inst.L, inst.c)) + p


def paper_critical_path(inst: Instance, j: int) -> float:
    """Eq. (3): z_j as the paper states it, decompression taken to wait for all E-chunks."""
    _, state, p = inst.tasks[j]
    if state == F:
        return p
    return (inst.rho * inst.u if reads_e(state) else 0.0) + max(
        inst.K * inst.c / min(inst.K, inst.L), inst.u if reads_sm(state) else 0.0) + p


def lower_bound(inst: Instance) -> float:
    """max{I, C/L, P, Z} of Lemma B.3 (Z from the exact critical paths)."""
    I = sum(io_workload(inst, j) for j in range(inst.n))
    C_total = sum(inst.K * inst.c for _, state, _ in inst.tasks if state != F)
    P = sum(inst.expert_p().values())
    Z = max(critical_path(inst, j) for j in range(inst.n)) if inst.tasks else 0.0
    return max(I, C_total / inst.L, P, Z)


#
# the optimum
#

def brute_force(inst: Instance, mode: str = "start") -> float:
    """Minimum makespan over every I/O order and every decompression order, without any reduction."""
    best = math.inf
    decs = inst.decompressions()
    for io in itertools.permutations(inst.reads()):
        for dec in itertools.permutations(decs):
            best = min(best, simulate(inst, list(io), list(dec), mode).makespan)
    return best


def optimal(inst: Instance, upper: float = math.inf) -> float:
    """The optimal makespan (or `upper` if no schedule beats it), by exact branch and bound.

    Why the search space holds an optimal schedule:
    - The reads have no predecessors, so in some optimal schedule the I/O thread never idles: its
      schedule is a permutation of the reads, done back to back.
    - Fix the release time r of each decompression. Sort the decompressions of any feasible
      schedule by start time into pi and start each, in that order, at
      s_i = max(r_i, s_{i-1}, s_{i-L} + c) (the earliest free worker). As all last c, at most L - 1
      of the earlier-started ones still run at the original start of op i, so s_{i-L} + c is at most
      that start: by induction no op starts later. Completion times only drop, and the makespan is
      non-decreasing in them (the stream's earliest-ready-first order is optimal for any ready
      times), so (reads permutation) x (start order pi, started as early as possible) holds an
      optimum. Work-conserving priority lists do not: waiting for a critical E-chunk can beat
      starting an available decompression (see the tests).
    - The shards of a task are interchangeable in the reads and decompressions alike, so the E-chunks
      of a task are read in shard order; then swapping two shards of a task that start out of
      release order keeps the task's completion, so its decompressions start in shard order.
      Tasks identical in expert, state and progress are interchangeable: one of them is branched on.
    Pruning uses lower bounds only (per task, the best it could do alone from the node, then the
    stream's earliest-ready-first makespan; the end of the reads; Lemma B.3), never a heuristic.
    """
    K, L, c, u, t_e = inst.K, inst.L, inst.c, inst.u, inst.t_e
    n = inst.n
    expert_p = inst.expert_p()
    states = [st for _, st, _ in inst.tasks]
    experts = [ex for ex, _, _ in inst.tasks]
    work = [j for j in range(n) if states[j] != F]
    by_expert = {ex: [j for j in work if experts[j] == ex] for ex in expert_p}
    min_p = min((expert_p[experts[j]] for j in work), default=0.0)
    total_io = sum(io_workload(inst, j) for j in range(n))
    root = lower_bound(inst)
    best = upper
    eps = 1e-12 * max(1.0, upper if upper < math.inf else 1.0)

    # -- inner: decompression start order for fixed release times (rel[j]) and SM arrivals (sm[j])
    def solve_decompression(rel, sm):
        nxt = [0] * n
        last = [0.0] * n

        def lb(free, prev):
            # an expert is ready no earlier than its own remaining shards allow alone
            ready = {}
            for ex, tasks in by_expert.items():
                pending = [r for j in tasks for r in rel[j][nxt[j]:]]
                t = max([0.0] + [max(sm[j], last[j]) for j in tasks])
                ready[ex] = max(t, _decompress_alone(pending, L, c, free, prev)) if pending else t
            value = gpu_makespan(ready, expert_p)[0]
            pending = [r for j in work for r in rel[j][nxt[j]:]]
            if pending:  # the last shard to end, then its expert
                value = max(value, _decompress_alone(pending, L, c, free, prev) + min_p)
            return value

        def dfs(free, prev, left):
            nonlocal best
            if left == 0:
                ready = {ex: max([0.0] + [max(sm[j], last[j]) for j in tasks]) for ex, tasks in by_expert.items()}
                best = min(best, gpu_makespan(ready, expert_p)[0])
                return
            if lb(free, prev) >= best - eps:
                return
            seen = set()
            for j in work:
                if nxt[j] == K:
                    continue
                key = (experts[j], tuple(rel[j]), sm[j], nxt[j], last[j])
                if key in seen:
                    continue
                seen.add(key)
                start = max(rel[j][nxt[j]], prev, free[0])
                end = start + c
                saved = last[j]
                nxt[j] += 1
                last[j] = max(last[j], end)
                dfs(sorted(free[1:] + [end]), start, left - 1)
                nxt[j] -= 1
                last[j] = saved

        dfs([0.0] * L, 0.0, K * len(work))

    # -- outer: the I/O order
    e_read = [0] * n
    rel = [[] if reads_e(st) else [0.0] * K for st in states]
    sm = [None if reads_sm(st) else 0.0 for st in states]

    def outer_lb(t: float) -> float:
        # reads left end no earlier than if they came next, an expert's own ones first
        ready, known, n_unread, last_read = {}, [], 0, math.inf
        for ex, tasks in by_expert.items():
            e_left = sum(K - len(rel[j]) for j in tasks)
            sm_left = sum(sm[j] is None for j in tasks)
            releases = [r for j in tasks for r in rel[j]]
            known += releases
            n_unread += e_left
            t_ready = max([0.0] + [sm[j] for j in tasks if sm[j] is not None])
            if sm_left:
                t_ready = max(t_ready, t + sm_left * u)
            if e_left or sm_left:  # its last read, then a shard if that read is an E-chunk
                t_ready = max(t_ready, t + e_left * t_e + sm_left * u + (0.0 if sm_left else c))
                last_read = min(last_read, (0.0 if sm_left else c) + expert_p[ex])
            pending = releases + [t + k * t_e for k in range(1, e_left + 1)]
            ready[ex] = max(t_ready, _decompress_alone(pending, L, c)) if pending else t_ready
        value = gpu_makespan(ready, expert_p)[0]
        if last_read < math.inf:  # the reads end with the I/O workload, the last one's expert runs after
            value = max(value, total_io + last_read)
        pending = known + [t + k * t_e for k in range(1, n_unread + 1)]
        if pending:
            value = max(value, _decompress_alone(pending, L, c) + min_p)
        return value

    def outer(t: float, left: int):
        if left == 0:
            solve_decompression([list(r) for r in rel], list(sm))
            return
        if outer_lb(t) >= best - eps:
            return
        seen = set()
        for j in work:
            key = (experts[j], states[j], e_read[j], tuple(rel[j]), sm[j])
            if key in seen:
                continue
            seen.add(key)
            if reads_e(states[j]) and e_read[j] < K:
                e_read[j] += 1
                rel[j].append(t + t_e)
                outer(t + t_e, left - 1)
                rel[j].pop()
                e_read[j] -= 1
            if sm[j] is None:
                sm[j] = t + u
                outer(t + u, left - 1)
                sm[j] = None

    if root < best - eps:
        outer(0.0, len(inst.reads()))
    return best


#
# Algorithm 1, read as zipmoe-sched.c reads it (documented in ggml-zipmoe-policy.h)
#

def _block_ops(inst: Instance, blk):
    io = [(j, 1 + s) for j in blk if reads_e(inst.state(j)) for s in range(inst.K)]
    io += [(j, 0) for j in blk if reads_sm(inst.state(j))]
    dec = [(j, 1 + s) for j in blk for s in range(inst.K)]
    return io, dec


def compute_dominant(inst: Instance, th: Threads, tol: float) -> bool:
    """Definition A.1 as §3.3 states it: the l-th earliest worker ends >= l*rho*u/K after the I/O thread."""
    return all(th.worker_end[l - 1] - th.io_end >= l * inst.t_e - tol for l in range(1, min(inst.L, inst.K) + 1))


def priority_sorted(inst: Instance, tasks) -> list:
    """Non-increasing p, an expert's tasks adjacent (ties on p by expert id), then task index."""
    return sorted(tasks, key=lambda j: (-inst.tasks[j][2], inst.tasks[j][0], j))


def reference_schedule(inst: Instance) -> dict:
    """Algorithm 1; the same output as ggml_zipmoe_schedule (io, dec, order, blocks, task_block)."""
    sigma_1 = priority_sorted(inst, [j for j in range(inst.n) if inst.state(j) != F and is_type_1(inst.state(j))])
    sigma_2 = priority_sorted(inst, [j for j in range(inst.n) if inst.state(j) != F and not is_type_1(inst.state(j))])
    io, dec, blocks = [], [], []

    def timing(blk):
        bio, bdec = _block_ops(inst, blk)
        th = run_threads(inst, io + bio, dec + bdec)
        return th.idle, compute_dominant(inst, th, inst.tol)

    while sigma_1 or sigma_2:
        blk = [sigma_1.pop(0) if sigma_1 else sigma_2.pop(0)]
        idle, dominant = timing(blk)
        while (sigma_1 or sigma_2) and not dominant:
            j = sigma_2.pop(0) if sigma_2 else sigma_1.pop(0)
            for pos in range(len(blk) + 1):
                trial = blk[:pos] + [j] + blk[pos:]
                t_idle, t_dominant = timing(trial)
                if t_idle <= idle + inst.tol:
                    break
            else:
                p = inst.tasks[j][2]
                last_2 = [i for i, k in enumerate(blk) if not is_type_1(inst.state(k)) and inst.tasks[k][2] >= p]
                last_1 = [i for i, k in enumerate(blk) if is_type_1(inst.state(k)) and inst.tasks[k][2] >= p]
                pos = (last_2[-1] if last_2 else last_1[-1] if last_1 else -1) + 1
                trial = blk[:pos] + [j] + blk[pos:]
                t_idle, t_dominant = timing(trial)
            blk, idle, dominant = trial, t_idle, t_dominant
        bio, bdec = _block_ops(inst, blk)
        io += bio
        dec += bdec
        blocks.append(blk)
    task_block = [-1] * inst.n
    for b, blk in enumerate(blocks):
        for j in blk:
            task_block[j] = b
    return {"io": io, "dec": dec, "order": [j for blk in blocks for j in blk], "blocks": blocks,
            "task_block": task_block}

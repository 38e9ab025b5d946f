"""The entity-disjoint cut: split statement rows so that no entity lies on both sides.

Statements and entities form a bipartite graph; its connected components can move between
sides without breaking disjointness. Small components are packed whole; large ones are cut by
giving each entity a side (grown greedily from a random entity, then refined by
Fiduccia-Mattheyses passes), dropping the statements whose two entities land on different
sides. See evaluation/splits.py for how the split uses it.
"""
from __future__ import annotations

import heapq

import numpy as np


def components(codes: np.ndarray) -> np.ndarray:
    """Component id per row of the statement-entity graph (rows without entities: alone)."""
    n = len(codes)
    parent = np.arange(n + int(codes.max(initial=-1)) + 1)  # rows 0..n-1, entity e -> node n + e

    def find(x):
        root = x
        while parent[root] != root:
            root = parent[root]
        while parent[x] != root:
            parent[x], x = root, parent[x]
        return root

    for r in range(n):
        for e in codes[r]:
            if e >= 0:
                a, b = find(r), find(n + e)
                if a != b:
                    parent[a] = b
    return np.array([find(r) for r in range(n)])


def bisect(codes, rows, share, rng, tolerance, n_starts, strata):
    """Split `rows` into (A, B, dropped): A about `share` of the kept rows, no entity in both.

    Small components are packed per stratum (the component's most common label), so that each
    label keeps its share on both sides."""
    comp = components(codes[rows])
    _, inverse, counts = np.unique(comp, return_inverse=True, return_counts=True)
    big = max(20, tolerance * len(rows))
    a_parts, b_parts, dropped = [], [], []
    for c in np.flatnonzero(counts >= big):       # cut each large component in proportion
        members = rows[inverse == c]
        in_a, in_b = _cut_component(codes[members], share, rng, tolerance, n_starts)
        a_parts.append(members[in_a])
        b_parts.append(members[in_b])
        dropped.append(members[~in_a & ~in_b])
    small = np.flatnonzero(counts < big)
    by_comp = rows[np.argsort(inverse, kind="stable")]
    starts = np.concatenate([[0], np.cumsum(counts)])
    filled: dict = {}                             # stratum -> [rows on A, rows on B]
    for c in small[rng.permutation(len(small))]:  # pack small components whole, random order
        members = by_comp[starts[c]:starts[c + 1]]
        values, freq = np.unique(strata[members], return_counts=True)
        count = filled.setdefault(values[np.argmax(freq)], [0, 0])
        to_a = count[0] < share * (count[0] + count[1]) or count == [0, 0]  # side below its share
        (a_parts if to_a else b_parts).append(members)
        count[0 if to_a else 1] += len(members)
    empty = np.zeros(0, dtype=np.int64)
    return tuple(np.concatenate(p) if p else empty for p in (a_parts, b_parts, dropped))


def _cut_component(codes, share, rng, tolerance, n_starts):
    """Entity sides for one connected component -> (row in A, row in B); other rows are dropped."""
    local, inverse = np.unique(codes[codes >= 0], return_inverse=True)
    ends = np.full(codes.shape, -1)
    ends[codes >= 0] = inverse
    u = ends[:, 0].copy()
    v = ends[:, -1].copy()  # a row has its first and last entity column as its two ends
    u[u < 0] = v[u < 0]
    v[v < 0] = u[v < 0]
    graph = _Graph(u, v, len(local))
    best = None
    for _ in range(max(1, int(n_starts))):
        side = graph.grow(share, rng)
        graph.refine(side, share, tolerance, rng)
        result = graph.evaluate(side)
        dev = abs(result[0] / max(result[0] + result[1], 1) - share)
        key = (dev > tolerance, result[2], dev)   # within tolerance first, then fewest drops
        if best is None or key < best[0]:
            best = (key, side.copy())
    side = best[1]
    return side[u] & side[v], ~side[u] & ~side[v]


class _Graph:
    """Entity graph of one component: rows are edges (u, v), u == v for one-entity rows."""

    def __init__(self, u, v, n_entities):
        self.u, self.v, self.m = u, v, n_entities
        self.rows = len(u)
        self.selfs = np.bincount(u[u == v], minlength=n_entities)
        others = u != v
        a = np.concatenate([u[others], v[others]])
        b = np.concatenate([v[others], u[others]])
        order = np.argsort(a, kind="stable")
        self.src, self.nbr = a[order], b[order]    # adjacency in CSR form
        self.degree = np.bincount(a, minlength=n_entities)
        self.start = np.concatenate([[0], np.cumsum(self.degree)])

    def neighbours(self, e):
        return self.nbr[self.start[e]:self.start[e + 1]]

    def evaluate(self, side):
        a, b = side[self.u], side[self.v]
        return int(np.sum(a & b)), int(np.sum(~a & ~b)), int(np.sum(a ^ b))

    def grow(self, share, rng):
        """Held-out side (True) grown from a random entity until its share of kept rows >= share."""
        side = np.zeros(self.m, dtype=bool)
        gain = -self.degree.astype(np.int64)     # (rows to A) - (rows to B), entities in B
        tie = rng.permutation(self.m)
        held, train = 0, self.rows
        heap: list = []
        pending = list(rng.permutation(self.m))      # random restarts when the frontier is empty
        while held < share * (held + train):
            e = -1
            while heap:
                g, _, cand = heapq.heappop(heap)
                if not side[cand] and -g == gain[cand]:
                    e = cand
                    break
            while e < 0 and pending:
                cand = pending.pop()
                if not side[cand]:
                    e = cand
            if e < 0:
                break
            nb = self.neighbours(e)
            to_a = int(np.sum(side[nb]))
            held += to_a + int(self.selfs[e])
            train -= (len(nb) - to_a) + int(self.selfs[e])
            side[e] = True
            for o in nb:
                if not side[o]:
                    gain[o] += 2
                    heapq.heappush(heap, (-int(gain[o]), int(tie[o]), int(o)))
        return side

    def refine(self, side, share, tolerance, rng, max_passes=8, patience=300):
        """Fiduccia-Mattheyses passes that keep the held-out share within tolerance; in place."""
        tie = rng.permutation(self.m)
        for _ in range(max_passes):
            held, train, cut = self.evaluate(side)
            same = np.bincount(self.src, weights=side[self.src] == side[self.nbr],
                               minlength=self.m).astype(np.int64)   # neighbours on e's side
            gain = self.degree - 2 * same               # drops removed by moving e across
            locked = np.zeros(self.m, dtype=bool)
            heaps = {True: [], False: []}
            for e in range(self.m):
                heaps[bool(side[e])].append((-int(gain[e]), int(tie[e]), e))
            for h in heaps.values():
                heapq.heapify(h)
            moves, best_cut, best_len, cur = [], cut, 0, cut

            def top(h, on_a):
                while h:
                    g, _, e = h[0]
                    if locked[e] or side[e] != on_a or -g != gain[e]:
                        heapq.heappop(h)
                        continue
                    return e
                return -1

            def after(e):
                s = int(self.selfs[e])
                k_same = int(same[e])
                k_other = int(self.degree[e]) - k_same
                if side[e]:
                    return held - k_same - s, train + k_other + s
                return held + k_other + s, train - k_same - s

            def ok(h_t):
                h, t = h_t
                if h + t == 0:
                    return False
                dev = abs(h / (h + t) - share)
                return dev <= tolerance or dev < abs(held / max(held + train, 1) - share)

            while True:
                cands = [e for e in (top(heaps[True], True), top(heaps[False], False)) if e >= 0]
                cands.sort(key=lambda e: (-gain[e], tie[e]))
                chosen = next((e for e in cands if ok(after(e))), -1)
                if chosen < 0:
                    break
                held, train = after(chosen)
                cur -= int(gain[chosen])
                self._move(chosen, side, same, gain)
                locked[chosen] = True
                moves.append(chosen)
                for o in set(self.neighbours(chosen).tolist()):
                    if not locked[o]:
                        heapq.heappush(heaps[bool(side[o])], (-int(gain[o]), int(tie[o]), o))
                if cur < best_cut and abs(held / max(held + train, 1) - share) <= tolerance:
                    best_cut, best_len = cur, len(moves)
                elif len(moves) - best_len > patience:
                    break
            for e in reversed(moves[best_len:]):       # roll back to the best prefix
                self._move(e, side, same, gain)
            if best_len == 0:
                return

    def _move(self, e, side, same, gain):
        nb = self.neighbours(e)
        old = side[e]
        side[e] = not old
        degree_e = len(nb)
        same[e] = degree_e - same[e]
        gain[e] = degree_e - 2 * same[e]
        for o in nb:
            if side[o] == old:      # was on e's side, now across
                same[o] -= 1
                gain[o] += 2
            else:                   # was across, now on e's side
                same[o] += 1
                gain[o] -= 2

"""Reading compiled programs: what their loop bodies do with parameter-sized memory."""

from __future__ import annotations

import collections
import re


def _computations(hlo: str) -> dict[str, list[str]]:
    out, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%([\w.\-]+) \(.*\{$", line)
        if head:
            name = head.group(1)
            out[name] = []
        elif name is not None and line.startswith("  "):
            out[name].append(line)
    return out


def inventory(hlo: str, num_slots: int, leaves: list[tuple[int, ...]]) -> collections.Counter:
    """Counts the parameter-sized and stack-sized instructions in the loop bodies of a compiled program by what they
    do (a fusion by its root op): ``"param copy"``, ``"stack dynamic-update-slice"``, ... ``leaves`` are the
    parameters' shapes; a stack is ``[num_slots, *leaf]``."""
    comps = _computations(hlo)
    bodies = {m for lines in comps.values() for line in lines for m in re.findall(r"body=%([\w.\-]+)", line)}

    def root_op(name: str) -> str:
        ops = [re.search(r"= \S+ ([\w-]+)\(", line) for line in comps.get(name, []) if "ROOT" in line]
        op = ops[0].group(1) if ops and ops[0] else "?"
        if op == "bitcast":  # look through a bitcast at what produced it
            line = next(x for x in comps[name] if "ROOT" in x)
            src = re.search(r"bitcast\(%([\w.\-]+)\)", line).group(1)
            op = next((re.search(r"= \S+ ([\w-]+)\(", x).group(1) for x in comps[name] if f"%{src} =" in x), op)
        return op

    counts: collections.Counter = collections.Counter()
    for name, lines in comps.items():
        if name not in bodies:  # what runs once per update (or per local step), not once per chunk
            continue
        for line in lines:
            m = re.match(r"\s*(?:ROOT )?%\S+ = f32\[([\d,]*)\]\S* ([\w-]+)\(", line)
            if not m:
                continue
            shape = tuple(int(d) for d in m.group(1).split(",") if d)
            op = m.group(2)
            if op in ("get-tuple-element", "parameter", "bitcast", "tuple"):  # names for buffers, no work
                continue
            if op == "fusion":
                op = root_op(re.search(r"calls=%([\w.\-]+)", line).group(1))
            if any(shape == (num_slots, *leaf) for leaf in leaves) and num_slots > 1:
                counts[f"stack {op}"] += 1
            elif any(shape in (leaf, (1, *leaf)) for leaf in leaves):
                counts[f"param {op}"] += 1
    return counts


def _reachable(comps: dict[str, list[str]], start: str) -> set[str]:
    """The computations ``start`` runs: itself and, transitively, every fusion, call, loop and branch it names."""
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for line in comps[name]:
            for group in re.findall(r"(?:calls|to_apply|body|condition|branch_computations)=\{?([^}\s]+)", line):
                todo += [n.lstrip("%") for n in group.rstrip(",").split(",")]
    return seen


def open_loops_in_update_loop(hlo: str) -> list[str]:
    """The ``while`` ops without a known trip count that run inside a compiled chunk's update loop (the loop whose
    body computes a gradient, a ``dot``), each as its metadata's op name. Such a loop asks the host whether to go on
    after every iteration on a GPU; one with a known trip count (a ``lax.scan``, a PRNG's rolled rounds) does not."""
    comps = _computations(hlo)
    found: list[str] = []
    for lines in comps.values():
        for line in lines:
            body = re.search(r" while\(.*body=%([\w.\-]+)", line)
            if not body:
                continue
            inside = _reachable(comps, body.group(1))
            if not any(re.search(r"= \S+ dot\(", x) for name in inside for x in comps[name]):
                continue  # not the update loop (the chunk's schedule, a PRNG's rolled loop)
            for name in inside:
                for x in comps[name]:
                    if re.search(r" while\(", x) and "known_trip_count" not in x:
                        op = re.search(r'op_name="([^"]+)"', x)
                        found.append(op.group(1) if op else x.strip()[:80])
    return found

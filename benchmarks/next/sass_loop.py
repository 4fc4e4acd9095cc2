"""Read the main loop of a kernel's SASS (nvdisasm -c output): the instructions between the label
a backward branch jumps to and that branch, as an opcode histogram, the barriers / waits in
order, and the HMMA dependency chains (an HMMA whose accumulator operand is the destination of an
earlier HMMA of the same iteration extends that HMMA's chain).

    python3 benchmarks/next/sass_loop.py KERNEL.sass
"""

import collections
import re
import sys

INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")


def parse(path):
    labels, insns = {}, []
    with open(path) as fh:
        lines = fh.read().splitlines()
    for line in lines:
        m = re.match(r"\s*(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(insns)
            continue
        m = INSN.search(line)
        if m:
            insns.append((int(m.group(1), 16), m.group(3), m.group(4).strip(), m.group(2) or ""))
    return labels, insns


def main_loop(labels, insns):
    """(first, last) index of the longest backward-branch loop."""
    best = None
    for i, (_, op, args, _) in enumerate(insns):
        if op.startswith("BRA"):
            m = re.search(r"\.L_x_\d+", args)
            if m and labels.get(m.group(0), i + 1) <= i:
                lo = labels[m.group(0)]
                if best is None or i - lo > best[1] - best[0]:
                    best = (lo, i)
    return best


def regs(text):
    return re.findall(r"\bR(\d+)\b", text)


def hmma_chains(body):
    """Length of the longest HMMA accumulator chain, and the number of chains."""
    depth = {}  # register -> chain depth of the HMMA that wrote it
    chains = []
    for _, op, args, _ in body:
        if not op.startswith("HMMA"):
            continue
        ops = [a.strip() for a in args.split(",")]
        dst, acc = ops[0], ops[-1]
        d = depth.get(acc, 0) + 1 if acc != "RZ" else 1
        depth[dst] = d
        chains.append(d)
    return max(chains or [0]), sum(1 for d in chains if d == 1)


def report(path):
    labels, insns = parse(path)
    lo, hi = main_loop(labels, insns)
    body = insns[lo:hi + 1]
    hist = collections.Counter(op.split(".")[0] for _, op, _, _ in body)
    longest, n = hmma_chains(body)
    print(f"{path}: main loop {len(body)} instructions")
    print("  ", dict(sorted(hist.items(), key=lambda x: -x[1])))
    print(f"   HMMA chains: {n} starting in the loop, longest {longest} dependent HMMAs")
    print("   order of waits / barriers / HMMA runs / copies:")
    run = None
    for _, op, args, pred in body:
        key = op.split(".")[0]
        if key in ("HMMA", "LDSM", "LDGSTS", "SHFL", "MUFU"):
            if run and run[0] == key:
                run[1] += 1
                continue
            if run:
                print(f"      {run[0]} x{run[1]}")
            run = [key, 1]
        elif key in ("BAR", "DEPBAR", "LDGDEPBAR", "STSM", "BRA"):
            if run:
                print(f"      {run[0]} x{run[1]}")
                run = None
            print(f"      {pred}{op} {args}")
    if run:
        print(f"      {run[0]} x{run[1]}")


if __name__ == "__main__":
    try:
        for p in sys.argv[1:]:
            report(p)
    except BrokenPipeError:
        pass

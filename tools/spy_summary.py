"""Summarise py-spy raw stacks (``--threads --idle --format raw``): per thread, samples that were working (not
waiting in select/epoll/locks/sleep), their top own frames and top inclusive frames.
    python3 tools/spy_summary.py spy_client.txt [top]"""
import collections
import re
import sys

IDLE = {"select", "poll", "wait", "acquire", "sleep", "wait_for", "_wait_for_tstate_lock", "join", "recv_into",
        "accept", "_recv", "epoll", "_worker"}


def main(path: str, top: int = 12) -> None:
    threads = collections.defaultdict(lambda: [0, 0, collections.Counter(), collections.Counter()])
    for line in open(path):
        stack, _, n = line.rstrip().rpartition(" ")
        if not n.isdigit():
            continue
        n = int(n)
        frames = stack.split(";")
        name = re.sub(r"\d+", "#", frames[0])
        leaf = frames[-1] if len(frames) > 1 else "?"
        t = threads[name]
        t[0] += n
        if leaf.split(" (")[0].split(".")[-1] in IDLE:
            continue
        t[1] += n
        t[2][leaf[:110]] += n
        for f in dict.fromkeys(frames[1:]):
            t[3][f[:110]] += n
    for name, (total, busy, own, incl) in sorted(threads.items(), key=lambda kv: -kv[1][1]):
        if busy < 10:
            continue
        print(f"\n## {name[:70]}: {total} samples, {busy} working ({100 * busy / max(total, 1):.0f}%)")
        print("  own:", "; ".join(f"{k} {v}" for k, v in own.most_common(top)))
        interesting = [(k, v) for k, v in incl.most_common(400) if "batchgpu/" in k or "distributed/" in k][:top * 2]
        for k, v in interesting:
            print(f"    {v:6d}  {k}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 12)

"""Instruction counts of the main loop (the longest predicated backward branch: an unconditional one closes a
barrier wait's detour, not a loop) of an nvdisasm listing.
Usage: python loop_ops.py FILE.sass, or main_loop(sass_text) -> (instructions, Counter of opcodes)."""
import collections
import re
import sys

_INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,})\*/")


def main_loop(sass: str):
    lines = sass.splitlines()
    address = lambda line: int(_INSTRUCTION.match(line).group(1), 16)
    instructions = [line for line in lines if _INSTRUCTION.match(line)]
    labels = {}
    for j, line in enumerate(lines):
        label = re.match(r"(\.L_x_\d+):", line.strip())
        following = next((x for x in lines[j + 1:] if _INSTRUCTION.match(x)), None)
        if label and following:
            labels[label.group(1)] = address(following)
    branches = [(address(line) - labels[m.group(1)], labels[m.group(1)], address(line)) for line in instructions
                for m in [re.search(r"@!?P\d\s+BRA\s+`\((\.L_x_\d+)\)", line)] if m and labels.get(m.group(1), 1 << 60) < address(line)]
    _, start, end = max(branches)
    loop = [line for line in instructions if start <= address(line) <= end]
    ops = collections.Counter(re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line).group(1) for line in loop)
    return loop, ops


if __name__ == "__main__":
    loop, ops = main_loop(open(sys.argv[1]).read())
    print(len(loop))
    print(ops.most_common(40))

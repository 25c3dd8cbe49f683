import re, sys, collections
s = open(sys.argv[1]).read().splitlines()
A = lambda l: int(re.match(r"\s+/\*([0-9a-f]+)\*/", l).group(1), 16)
ins = [l for l in s if re.match(r"\s+/\*[0-9a-f]{4,}\*/", l)]
lab = {}
for j, l in enumerate(s):
    m = re.match(r"(\.L_x_\d+):", l.strip())
    if m:
        nxt = next((x for x in s[j + 1:] if re.match(r"\s+/\*[0-9a-f]{4,}\*/", x)), None)
        if nxt: lab[m.group(1)] = A(nxt)
best = max(((A(l) - lab[m.group(1)], lab[m.group(1)], A(l)) for l in ins
            for m in [re.search(r"BRA\s+`\((\.L_x_\d+)\)", l)] if m and lab.get(m.group(1), 1 << 60) < A(l)))
loop = [l for l in ins if best[1] <= A(l) <= best[2]]
c = collections.Counter(re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", l).group(1) for l in loop)
print(len(loop)); print(c.most_common(40))

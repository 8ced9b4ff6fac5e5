# bench/ktrace.cpp's trace of refit-bench generate: per decode step (bounded by the sampling
# kernel sample_pick) the time the kernels cover and the idle time, the kernels by name per step,
# one layer's timeline (from a decode attention kernel to the next) and the last layer to the
# step's end (lm_head, sampling).
#   python3 bench/ktrace.py /tmp/kt      (reads the largest /tmp/kt.<pid>)
import sys, glob, collections, re
files = sorted(glob.glob(sys.argv[1] + '.*'), key=lambda f: -sum(1 for _ in open(f)))
rows = []
for line in open(files[0]):
    p = line.rstrip('\n').split('\t', 3)
    if len(p) == 4:
        rows.append((int(p[0]), int(p[1]), p[2], p[3]))
rows.sort()
def short(n):
    n = re.sub(r'^void ', '', n).replace('(anonymous namespace)::', '')
    n = re.sub(r'\(.*$', '', n)
    base = n.split('<')[0].split('::')[-1]
    targs = n[len(n.split('<')[0]):][:40] if '<' in n else ''
    return (base + targs)[:70]
marks = [i for i, r in enumerate(rows) if 'sample_pick' in r[3]]
print('file', files[0], 'kernels', len(rows), 'steps', len(marks))
steps = list(zip(marks[-9:-1], marks[-8:]))
tot = collections.Counter(); cnt = collections.Counter()
for a, b in steps:
    seg = rows[a + 1:b + 1]
    t0 = rows[a][1]; t1 = seg[-1][1]
    busy = 0; end = t0; idle = 0
    for s, e, st, n in seg:
        if s > end: idle += s - end
        busy += max(0, e - max(s, end)) if e > end else 0
        end = max(end, e)
        tot[short(n)] += e - s; cnt[short(n)] += 1
    print('step %.3f ms  kernels %d  covered %.3f ms  idle %.3f ms' % ((t1 - t0) / 1e6, len(seg), busy / 1e6, idle / 1e6))
n = max(1, len(steps))
print('per step by kernel: us, count')
for k, v in tot.most_common(45):
    print('  %9.1f  %5d  %s' % (v / n / 1e3, cnt[k] // n, k))
a, b = steps[-1]
att = [i for i in range(a, b) if 'decode_attention' in rows[i][3]]
if len(att) > 3:
    i0, i1 = att[len(att) // 2], att[len(att) // 2 + 1]
    print('one layer (from a decode attention to the next): start offset us, duration us, name')
    base = rows[i0][0]
    for s, e, st, nme in rows[i0:i1 + 1]:
        print('  %8.2f %8.2f  %s' % ((s - base) / 1e3, (e - s) / 1e3, short(nme)))
    print('first attention -> last kernel of the step')
    j = att[-1]
    for s, e, st, nme in rows[j:b + 1]:
        print('  %8.2f %8.2f  %s' % ((s - rows[j][0]) / 1e3, (e - s) / 1e3, short(nme)))

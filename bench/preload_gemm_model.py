#!/usr/bin/env python3
# A host model of runtime/inference/torch_kernels_preload.cu's index arithmetic, thread by thread:
# which weight chunks each lane copies into which shared-memory slot before the wait, the token
# tile and its swizzle, the A / B fragments each lane hands to mma.m16n8k16.row.col (the PTX
# fragment layouts), the partial sums' layout, the sum over the block's warps and over the
# cluster's blocks, and which output elements each block writes. Small integer inputs make every
# product exact, so the result must equal the plain matrix product exactly. It checks the
# arithmetic as the kernel is written (keep it in step with the .cu); it is not a test of the
# CUDA code, which test_gpu_preload_gemm checks on a GPU.
#   python3 bench/preload_gemm_model.py        every case (about a minute)
import sys, random
def run(RT, KC, WR, WK, NG, MT, PARTS, m, n, k, split):
    NT = WR*RT*16; KW = KC*32; KS = WK*KW; warps = WR*WK; threads = warps*32
    assert k == KS*split and n % 16 == 0  # a ragged last tile where NT does not divide n
    R = random.Random(1)
    mat = lambda a, b: [[R.randint(-4, 4) for _ in range(b)] for _ in range(a)]
    x = mat(m, k); xlo = mat(m, k); w = mat(n, k)
    y = [[None]*n for _ in range(m)]
    tiles = (n + NT - 1) // NT
    stride = NT + 4
    row_chunks = KS // 8
    for tile in range(tiles):
        partials = {}
        for rank in range(split):
            k0 = rank*KS; row0 = tile*NT
            # weights: slot dict per warp
            wsl = {}
            for warp in range(warps):
                rg = warp % WR; kg = warp // WR
                for lane in range(32):
                    g = lane >> 2; t = lane & 3
                    wrow_r = row0 + rg*RT*16 + g
                    wrow_k = k0 + kg*KW + 8*t
                    for grp in range(NG):
                        for cc in range(KC//NG):
                            c = grp*(KC//NG)+cc
                            for rt in range(RT):
                                for h in range(2):
                                    r = min(wrow_r + rt*16 + h*8, n - 1); kk = wrow_k + c*32
                                    slot = ((c*RT+rt)*2+h)*32+lane
                                    assert 0 <= slot < RT*KC*2*32 and (warp, slot) not in wsl
                                    wsl[(warp, slot)] = w[r][kk:kk+8]
            # tokens
            tok = {}
            total = PARTS*MT*8*row_chunks
            for idx in range(total):
                part = idx // (MT*8*row_chunks); r = (idx // row_chunks) % (MT*8); q = idx % row_chunks
                src = x if part == 0 else xlo
                v = src[r][k0+q*8:k0+q*8+8] if r < m else [0]*8
                key = (part*MT*8 + r)*row_chunks + (q ^ ((r & 1) << 2))
                assert key not in tok
                tok[key] = v
            assert len(tok) == total
            partial = [None]*((WK*MT*8)*stride)
            for warp in range(warps):
                rg = warp % WR; kg = warp // WR
                acc = [[[[0]*4 for _ in range(32)] for _ in range(MT)] for _ in range(RT)]
                for c in range(KC):
                    a = [[[wsl[(warp, ((c*RT+rt)*2+h)*32+lane)] for lane in range(32)] for h in range(2)] for rt in range(RT)]
                    for nt in range(MT):
                        if nt*8 >= m: break
                        for p in range(PARTS):
                            b = []
                            for lane in range(32):
                                g = lane >> 2; t = lane & 3
                                q = (kg*KW + c*32)//8 + t
                                r = nt*8 + g
                                b.append(tok[(p*MT*8 + r)*row_chunks + (q ^ ((r & 1) << 2))])
                            for rt in range(RT):
                                for step in range(2):
                                    A = [[None]*16 for _ in range(16)]; B = [[None]*8 for _ in range(16)]
                                    for lane in range(32):
                                        g = lane >> 2; t = lane & 3
                                        lo0 = a[rt][0][lane]; lo1 = a[rt][1][lane]; bb = b[lane]
                                        e = 4*step  # .x/.y for step 0, .z/.w for step 1
                                        for i in range(2):
                                            A[g][2*t+i] = lo0[e+i]; A[g+8][2*t+i] = lo1[e+i]
                                            A[g][2*t+8+i] = lo0[e+2+i]; A[g+8][2*t+8+i] = lo1[e+2+i]
                                            B[2*t+i][g] = bb[e+i]; B[2*t+8+i][g] = bb[e+2+i]
                                    D = [[sum(A[r][kk]*B[kk][cc] for kk in range(16)) for cc in range(8)] for r in range(16)]
                                    for lane in range(32):
                                        g = lane >> 2; t = lane & 3
                                        v = [D[g][2*t], D[g][2*t+1], D[g+8][2*t], D[g+8][2*t+1]]
                                        for i in range(4): acc[rt][nt][lane][i] += v[i]
                for lane in range(32):
                    g = lane >> 2; t = lane & 3
                    for rt in range(RT):
                        for nt in range(MT):
                            for i in range(4):
                                row = (rg*RT+rt)*16 + g + (i >> 1)*8
                                token = nt*8 + 2*t + (i & 1)
                                assert partial[(kg*MT*8+token)*stride + row] is None
                                partial[(kg*MT*8+token)*stride + row] = acc[rt][nt][lane][i]
            if WK > 1:
                for e in range(m*(NT//2)):
                    token = e // (NT//2); row = (e % (NT//2))*2
                    for j in range(1, WK):
                        for d in range(2):
                            partial[token*stride+row+d] += partial[(j*MT*8+token)*stride+row+d]
            partials[rank] = partial
        own = NT // split
        for rank in range(split):
            for e in range(m*(own//2)):
                token = e // (own//2); row = rank*own + (e % (own//2))*2
                if tile*NT + row >= n:
                    continue  # a ragged tile's rows past n: not written
                s = [0, 0]
                for r in range(split):
                    for d in range(2): s[d] += partials[r][token*stride+row+d]
                for d in range(2):
                    assert y[token][tile*NT+row+d] is None
                    y[token][tile*NT+row+d] = s[d]
    err = 0
    for i in range(m):
        for j in range(n):
            ref = sum((x[i][c] + (xlo[i][c] if PARTS == 2 else 0))*w[j][c] for c in range(k))
            assert y[i][j] is not None, "unwritten"
            err = max(err, abs(y[i][j]-ref))
    print(RT, KC, WR, WK, NG, MT, PARTS, m, n, k, split, "max err", err)
    assert err == 0
CASES = [  # RT, KC, WR, WK, NG, MT, PARTS, m, n, k, split: the kernel's seven shapes, ragged too
    (2, 8, 5, 2, 4, 8, 1, 37, 160, 1024, 2),
    (4, 4, 2, 4, 4, 4, 1, 17, 256, 1024, 2),
    (4, 4, 2, 4, 4, 8, 1, 64, 128, 4096, 8),  # o_proj's k and cluster size
    (1, 1, 1, 8, 1, 8, 2, 64, 32, 512, 2),
    (1, 1, 1, 8, 1, 2, 2, 5, 16, 1024, 4),
    (1, 2, 2, 2, 1, 8, 1, 41, 96, 256, 2),
    (1, 1, 1, 4, 1, 4, 2, 23, 16, 512, 4),
    (2, 8, 10, 1, 4, 8, 1, 64, 320, 2048, 8),  # qkv's k in clusters of 8
    (2, 8, 11, 1, 4, 8, 1, 64, 368, 2048, 8),  # shape 6, the last tile 336 rows short (16 of 352 live)
    (2, 8, 5, 2, 4, 8, 1, 33, 336, 4096, 8),   # shape 0 ragged at o_proj's k (144 short)
    (1, 2, 2, 2, 1, 4, 1, 19, 80, 512, 4),     # shape 3 ragged (16 short)
]
SMEM_LIMIT = 232448  # bytes of dynamic shared memory a block may take on sm_90
for RT, KC, WR, WK, NG, MT, PARTS, *_ in CASES:
    NT = WR*RT*16; KS = WK*KC*32
    for mt in (2, 4, 8):
        weights = WR*WK*RT*KC*2*32*16; tokens = PARTS*mt*8*KS*2; partial = WK*mt*8*(NT+4)*4
        assert max(weights + tokens, partial) <= SMEM_LIMIT, (RT, KC, WR, WK, mt)
for case in CASES if len(sys.argv) < 2 else [CASES[int(sys.argv[1])]]:
    run(*case)
print("all cases exact")

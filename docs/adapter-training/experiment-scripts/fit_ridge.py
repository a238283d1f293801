import sys; sys.path.insert(0, "/work/exp13")
from common import *
s, t = load_pair("small", device="cpu"); del s
cache = TeacherCache(EXP / "cache")
tr, dev, test = split(cache)
adapter, stats, info = ridge(t, cache, tr[:int(sys.argv[1])], dev)
print(info, adapter.meta.lambdas, flush=True)

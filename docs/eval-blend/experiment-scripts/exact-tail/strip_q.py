"""One-off: drop the queries from the teacher cache (KL stages do not read them) and mark its index so."""
import json
from pathlib import Path
from safetensors.torch import load_file, save_file
root = Path("/work/exp16/work/teacher")
index = json.loads((root / "index.json").read_text())
for e in index["windows"]:
    f = root / e["file"]
    t = load_file(str(f))
    if "q" in t:
        del t["q"]
        tmp = f.with_suffix(".tmp")
        save_file(t, str(tmp)); tmp.replace(f)
index["config"]["queries"] = False
(root / "index.json").write_text(json.dumps(index))
print(len(index["windows"]), "windows")

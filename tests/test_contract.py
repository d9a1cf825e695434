"""The house rules that keep a copied recipe working and the planner made of stages,
checked on the code itself (single process, a few seconds):

- ds_ext reaches the recipes only through the registry (``recipes``: get_recipe,
  spec_for, RECIPES, recipe_section_classes) and the spec: no import of a module under
  recipes/ but the registry, and no isinstance of a class a recipe defines;
- no import circle between the project's files, function-level imports included;
- no function of the planner package over 80 lines;
- the planner's stages on their own: the layer rows count routed experts through the
  spec's predicate, and the balanced cut is the same whatever hardware a plan is made
  for (it is costed on the run's own figures);
- the memory pipeline resumes at DeepSpeed's global_samples exactly where the step
  count put it.
"""

import ast
import glob
import json
import os

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sources(*patterns):
    for pattern in patterns:
        for path in sorted(glob.glob(os.path.join(ROOT, pattern), recursive=True)):
            yield os.path.relpath(path, ROOT), ast.parse(open(path).read())


def _imports(rel, tree):
    """(module imported, line) of every import in a file, relative ones resolved."""
    package = rel[:-3].replace(os.sep, ".")
    package = package[:-len(".__init__")] if package.endswith(".__init__") else package.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            yield module, node.lineno
            for alias in node.names:
                yield f"{module}.{alias.name}", node.lineno


def test_ds_ext_reaches_recipes_only_through_the_registry():
    recipe_classes = {node.name for _, tree in _sources("recipes/**/*.py") for node in ast.walk(tree)
                      if isinstance(node, ast.ClassDef)}
    registry = {"recipes", "recipes.get_recipe", "recipes.spec_for", "recipes.RECIPES",
                "recipes.recipe_section_classes"}
    found = []
    for rel, tree in _sources("ds_ext/**/*.py"):
        for module, line in _imports(rel, tree):
            if module.split(".")[0] == "recipes" and module not in registry:
                found.append(f"{rel}:{line} imports {module}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("isinstance", "issubclass"):
                names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                names |= {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
                # DeepSpeed's MoE base class is DeepSpeed's, not a recipe's
                for name in names & recipe_classes - {"MoE"}:
                    found.append(f"{rel}:{node.lineno} isinstance of recipe class {name}")
    assert not found, "ds_ext must ask the recipe spec (recipes/spec.py):\n" + "\n".join(found)


def _module_file(module):
    path = os.path.join(ROOT, *module.split("."))
    for candidate in (path + ".py", os.path.join(path, "__init__.py")):
        if os.path.isfile(candidate):
            return os.path.relpath(candidate, ROOT)
    return None


def test_no_import_circles_between_the_projects_files():
    graph = {}
    for rel, tree in _sources("ds_ext/**/*.py", "recipes/**/*.py", "launch/*.py"):
        targets = {_module_file(m) for m, _ in _imports(rel, tree) if m and m.split(".")[0] in ("ds_ext", "recipes")}
        # a package's __init__ re-exporting its own modules is not a loop of the code
        graph[rel] = {t for t in targets if t and t != rel and not (rel.endswith("__init__.py")
                                                                   and t.startswith(os.path.dirname(rel)))}
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))
    for v in list(graph):
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_no_planner_function_needs_a_scroll_bar():
    long = [f"{rel}:{node.name} {node.end_lineno - node.lineno + 1} lines"
            for rel, tree in _sources("ds_ext/planner/*.py") for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80]
    assert not long, long


def test_layer_rows_count_routed_experts_through_the_spec():
    """The rows' expert parameters equal the DeepSeekMoE blocks' own, counted here by
    class (the planner itself asks the spec), and the activated parameters of a MoE layer
    keep top_k / n_routed_experts of them."""
    from ds_ext.planner.layers import layer_rows
    from recipes import get_recipe
    from recipes.layers.moe import DeepSeekMoE
    recipe = get_recipe("deepseek_v3")
    config = recipe.make_config("tiny-moe")
    specs = recipe.layer_specs(config, seed=0)
    rows = layer_rows(specs, config, recipe)
    seen_moe = False
    for spec, row in zip(specs, rows):
        with torch.device("meta"):
            module = spec.build()
        experts = sum(p.numel() for m in module.modules() if isinstance(m, DeepSeekMoE) for p in m.experts.parameters())
        assert row["experts"] == experts
        if experts:
            seen_moe = True
            k, e = config.num_experts_per_tok, config.n_routed_experts
            assert row["active"] == row["params"] - experts + experts * k // e
    assert seen_moe


def _balanced_config(tmp_path):
    with open(os.path.join(ROOT, "ds_configs", "tiny_moe_cpu.json")) as f:
        ds = json.load(f)
    ds.setdefault("pipeline", {})["partition"] = "balanced"
    path = tmp_path / "balanced.json"
    path.write_text(json.dumps(ds))
    return str(path)


def test_the_balanced_cut_does_not_depend_on_the_plans_hardware(tmp_path):
    """A plan for other hardware shows the cut the run makes: the one costed on
    cut_hardware (seekspeed.topology's figures)."""
    from ds_ext.config import load_config
    from ds_ext.planner import Hardware, cut_hardware, make_plan
    path = _balanced_config(tmp_path)
    cfg = load_config(path, world_size=2)
    on_cut = make_plan(cfg, nodes=1, ranks_per_node=2, hardware=cut_hardware(cfg.section.topology, 2))
    elsewhere = make_plan(cfg, nodes=1, ranks_per_node=2, hardware=Hardware(peak_tflops=50.0, hbm_gbps=300.0))
    assert on_cut.bounds == elsewhere.bounds
    assert on_cut.layer_seconds != elsewhere.layer_seconds      # the hardware did change the costs


@pytest.mark.parametrize("replicas,grad_accum,steps", [(1, 4, 7), (3, 2, 5)])
def test_memory_batches_resume_at_global_samples(replicas, grad_accum, steps):
    """DeepSpeed's global_samples after ``steps`` steps is steps x micro x accumulation x
    replicas; seeking there continues at micro-batch steps x accumulation of this
    replica's stream, as the step count says."""
    from ds_ext.data.packing import PackedBatches
    rows = np.arange(50 * 9, dtype=np.int64).reshape(50, 9)
    micro = 4
    ran = PackedBatches(rows, micro_batch=micro, seed=5, num_shards=replicas)
    for _ in range(steps * grad_accum):
        next(ran)
    resumed = PackedBatches(rows, micro_batch=micro, seed=5, num_shards=replicas)
    resumed.seek(steps * micro * grad_accum * replicas)
    assert resumed.position == ran.position
    assert all((a == b).all() for a, b in zip(next(ran), next(resumed)))

"""Every ``%%ddp`` cell that would run on NCCL gives collectives and DDP tensors and models on ``device``.

    .venv/bin/python -m pytest tests/test_nccl_cells.py -q

No GPU is needed: this is a static scan (``ast``) of the notebooks' ``%%ddp`` cells, in notebook order,
and of the ``course_utils`` helpers those cells call.

Why. ``%%ddp -n N`` picks NCCL when N GPUs are visible (``choose_backend``), and the ranks then get
``device = cuda:local_rank``. NCCL serves CUDA tensors only: a CPU tensor handed to ``dist.all_reduce``
and the other collectives raises on NCCL, and so does a CPU model handed to DDP. CI runs gloo on the CPU,
where such a cell works, so only this scan catches it before a learner with GPUs does.

The rule (what fails the test):

* Which cells: every ``%%ddp`` cell that does not run on gloo for sure, whatever its ``-n`` (a machine with
  enough GPUs gives every size NCCL). A cell runs on the backend the notebook's cluster was last asked for:
  ``--backend gloo`` on a cell pins that cell *and the cells after it* (the engine keeps the requested
  backend across cells and across a new ``-n``) until a cell asks for ``--backend auto|nccl`` or a
  ``%ddp shutdown`` starts afresh (``magic._cluster_for``).
* What it may not do: pass a tensor or a model that was *built on the CPU and never moved* to

  - a collective of ``torch.distributed`` (``all_reduce``, ``broadcast``, ``reduce``, ``all_gather``,
    ``all_gather_into_tensor``, ``reduce_scatter``, ``reduce_scatter_tensor``, ``all_to_all``,
    ``all_to_all_single``, ``scatter``, ``gather``, ``send``, ``recv``, ``isend``, ``irecv``, ``P2POp``);
    ``barrier`` and the ``*_object`` collectives take no tensor and are fine;
  - ``DistributedDataParallel``/``DDP``, ``FullyShardedDataParallel``/``FSDP``, ``fully_shard``,
    ``ZeroRedundancyOptimizer``, ``MicroDDP``, ``MicroFSDP``, or any class that calls collectives;
  - a function of the cell (or of an earlier cell) or a ``course_utils`` helper that hands that argument
    on to one of the above (``ring_all_reduce(t)``, ``MicroDDP(model)``);
  - nor may the cell call a ``course_utils`` helper that itself builds a CPU tensor or model and hands it
    to one of the above, or to a function the cell gave it that runs collectives on its arguments (a
    checker calling the learner's ``start_allreduce`` with a CPU bucket): such a helper would crash on
    NCCL, so every cell that calls it fails until the helper is fixed. The helpers are read from the same
    revision as the notebooks.
* Built on the CPU: a torch tensor constructor (``torch.ones``, ``zeros``, ``tensor``, ``arange``,
  ``randn``, ``rand``, ``randint``, ``empty``, ``full``, ...) without ``device=``; ``*_like(t)`` of such a
  tensor; an ``nn`` module or an ``nn.Module`` subclass constructed without ``device=`` (e.g.
  ``make_model(...)``, ``nn.Linear(...)``); a ``course_utils`` helper that returns one of those; and
  everything computed from them: slices, ``.grad``, ``.parameters()``, ``.clone()``, ``torch.cat``,
  arithmetic, a list of them, a loop variable over them, a local function's return value.
* Moved: ``.to(device)``, ``.cuda()``, ``device=device`` (any device expression that is not ``"cpu"``),
  ``torch.*_like`` of a moved tensor, or a model's ``model.to(device)`` statement. Drawing on the CPU and
  then moving (``torch.randn(8, 4, generator=g).to(device)``) is fine, and it is what keeps a cell's
  numbers the same on both backends.
* Escape hatches, each with its reason in the code: ``%%ddp ... --backend gloo`` (the lesson is about the
  CPU from there on; say so in one sentence beside the cell), or a branch that only runs on gloo:
  ``if dist.get_backend() == "gloo":`` (or ``!= "nccl"``, ``device.type == "cpu"``; the ``else`` of the
  opposite test). A value that is CPU on one branch and on ``device`` on the other (``torch.device("cuda")
  if ... == "nccl" else torch.device("cpu")``) counts as moved.

Also reported, without failing: the census of tensor constructors without ``device=`` in those cells
(tensors drawn on the CPU); most are fine (drawn on the CPU, then moved).

The scan is heuristic in one documented way: a function that a cell defines but does not call (it hands
it to a helper) is checked with its parameters taken from the notebook's names of the same name (the
course's fixed names: ``model``, ``optimizer``, ...).
"""
import ast
import json
import re
import subprocess

import pytest

from conftest import LESSONS, ROOT, in_ci

OLD = "6afd948"  # the lessons before any was made right for NCCL: cells known to crash there, the scan's positives
EMPTY = frozenset()
CPU, DEV = frozenset({"cpu"}), frozenset({"dev"})

# collective -> positions of its tensor arguments; keywords in TENSOR_KEYWORDS count too
COLLECTIVES = {
    "all_reduce": (0,), "broadcast": (0,), "reduce": (0,), "send": (0,), "recv": (0,), "isend": (0,),
    "irecv": (0,), "all_gather": (0, 1), "all_gather_into_tensor": (0, 1), "_all_gather_base": (0, 1),
    "reduce_scatter": (0, 1), "reduce_scatter_tensor": (0, 1), "_reduce_scatter_base": (0, 1),
    "all_to_all": (0, 1), "all_to_all_single": (0, 1), "scatter": (0, 1), "gather": (0, 1),
    "all_reduce_coalesced": (0,), "all_gather_coalesced": (0, 1), "P2POp": (1,),
}
TENSOR_KEYWORDS = {"tensor", "tensors", "tensor_list", "output", "input", "output_tensor", "input_tensor",
                   "output_tensor_list", "input_tensor_list", "input_list", "output_tensor_lists",
                   "scatter_list", "gather_list", "module", "params"}
WRAPPERS = {"DistributedDataParallel", "DDP", "FullyShardedDataParallel", "FSDP", "fully_shard",
            "ZeroRedundancyOptimizer", "MicroDDP", "MicroFSDP"}
TENSOR_CTORS = {"tensor", "as_tensor", "from_numpy", "ones", "zeros", "empty", "full", "arange", "range",
                "linspace", "logspace", "eye", "rand", "randn", "randint", "randperm", "empty_strided",
                "Tensor", "FloatTensor", "DoubleTensor", "HalfTensor", "BFloat16Tensor", "LongTensor",
                "IntTensor", "ShortTensor", "ByteTensor", "BoolTensor", "sparse_coo_tensor"}
LIKE_CTORS = {"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like"}
ALIASES = {"torch": "torch", "dist": "torch.distributed", "nn": "torch.nn", "F": "torch.nn.functional",
           "DDP": "torch.nn.parallel.DistributedDataParallel"}


class Ext:
    """A name bound to a module or an object outside the scanned code: its qualified name."""

    def __init__(self, q):
        self.q = q


class Func:
    def __init__(self, node, where):
        self.node, self.where = node, where  # where: text naming the cell or module that defines it


class Cls:
    def __init__(self, node, is_module, collective):
        self.node, self.is_module, self.collective = node, is_module, collective


class Summary:
    """What a course_utils function or class does with its arguments, from its source."""

    def __init__(self, params=()):
        self.params = list(params)   # positional order, for matching a call's arguments
        self.consumed = set()        # parameters that reach a collective or DDP
        self.internal = []           # CPU tensors or models it builds and hands to a collective itself
        self.feeds = []              # (parameter, text): CPU tensors it hands to a function it was given
        self.returns = EMPTY         # taint of the result; "arg:p" stands for the argument p
        self.collective = False      # it reaches a collective at all
        self.is_module = False       # a class that is an nn.Module


def _taint(v):
    return v if isinstance(v, frozenset) else EMPTY


def _join(*vs):
    out = set()
    for v in vs:
        out |= _taint(v)
    return frozenset(out)


def _is_cpu_only(t):
    return "cpu" in t and "dev" not in t


def _gloo_test(test):
    """For an ``if`` test: 'body' if its body runs only on gloo/CPU, 'orelse' if its else does, or None."""
    if not isinstance(test, ast.Compare) or len(test.ops) != 1:
        return None
    consts = [n.value for n in (test.left, *test.comparators) if isinstance(n, ast.Constant)]
    if len(consts) != 1 or not isinstance(consts[0], str):
        return None
    c, op = consts[0], test.ops[0]
    if c in ("gloo", "cpu"):
        return "body" if isinstance(op, (ast.Eq, ast.Is)) else "orelse" if isinstance(op, (ast.NotEq, ast.IsNot)) \
            else None
    if c in ("nccl", "cuda"):
        return "orelse" if isinstance(op, (ast.Eq, ast.Is)) else "body" if isinstance(op, (ast.NotEq, ast.IsNot)) \
            else None
    return None


class Scanner:
    """Reads course_utils sources through ``read(relative path) -> text or None`` (a revision's files)."""

    def __init__(self, read):
        self.read = read
        self.modules = {}     # module name -> env dict, or None
        self.summaries = {}   # qualified name -> Summary

    # -- course_utils ---------------------------------------------------------------------------------------
    def module_env(self, mod):
        if mod in self.modules:
            return self.modules[mod]
        self.modules[mod] = None
        path = mod.replace(".", "/")
        src = self.read(path + ".py")
        if src is None:
            src = self.read(path + "/__init__.py")
        if src is None or mod.startswith("course_utils.engine"):  # the engine is not lesson code
            return None
        try:
            tree = ast.parse(src)
        except SyntaxError as exc:  # a helper this check cannot read is a helper it would wave through
            raise AssertionError(f"{mod} does not parse, so the cells that call it cannot be checked: "
                                 f"{exc}") from None
        env = {}
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                _bind_import(env, node, mod)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                env[node.name] = Ext(f"{mod}.{node.name}")
        env["__submodules__"] = [e.value for n in tree.body if isinstance(n, ast.Assign)
                                 and any(isinstance(t, ast.Name) and t.id == "MODULES" for t in n.targets)
                                 and isinstance(n.value, (ast.Tuple, ast.List))
                                 for e in n.value.elts if isinstance(e, ast.Constant)]  # lazy __getattr__
        env["__nodes__"] = {n.name: n for n in tree.body
                            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
        self.modules[mod] = env
        return env

    def summary(self, q, depth=0):
        """Summary of course_utils object ``q``, or None when it is not found."""
        if q in self.summaries:
            return self.summaries[q]
        if depth > 6:
            return None
        parts = q.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            mod, rest = ".".join(parts[:cut]), parts[cut:]
            env = self.module_env(mod)
            if env is None or len(rest) != 1:
                continue
            name = rest[0]
            node = env["__nodes__"].get(name)
            if node is None:
                target = env.get(name)
                if isinstance(target, Ext) and target.q != q and target.q.startswith("course_utils"):
                    return self.summary(target.q, depth + 1)
                for sub in env["__submodules__"]:
                    found = self.summary(f"{mod}.{sub}.{name}", depth + 1)
                    if found is not None:
                        return found
                return None
            s = self.summaries[q] = Summary()  # in progress: recursion sees an empty summary
            if isinstance(node, ast.ClassDef):
                self._summarise_class(s, node, env, mod)
            else:
                self._summarise_function(s, node, env, f"{mod}.{name}")
            return s
        return None

    def _summarise_function(self, s, node, env, where, skip_self=False):
        params = [a.arg for a in (*node.args.posonlyargs, *node.args.args)]
        if skip_self and params:
            params = params[1:]
        s.params = params
        local = dict(env)
        for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs):
            local[a.arg] = frozenset({f"arg:{a.arg}"})
        if skip_self:
            local[node.args.args[0].arg] = EMPTY if node.args.args else None
        for a in (node.args.vararg, node.args.kwarg):
            if a is not None:
                local[a.arg] = frozenset({f"arg:{a.arg}"})
        w = Walker(self, local, where, report=lambda _n, msg: s.internal.append(msg), summary=True)
        w.block(node.body)
        s.consumed |= w.consumed
        s.feeds += w.feeds
        s.returns = w.returns
        s.collective = w.collective
        return w

    def _summarise_class(self, s, node, env, mod):
        s.is_module = any((isinstance(b, ast.Attribute) and b.attr.endswith("Module"))
                          or (isinstance(b, ast.Name) and b.id.endswith("Module")) for b in node.bases)
        for b in node.bases:  # a subclass of a course_utils class inherits what it does
            base = env.get(b.id) if isinstance(b, ast.Name) else None
            if isinstance(base, Ext) and base.q.startswith("course_utils"):
                bs = self.summary(base.q)
                if bs is not None:
                    s.is_module |= bs.is_module
                    s.collective |= bs.collective
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.args.args:
                m = Summary()
                self._summarise_function(m, item, env, f"{mod}.{node.name}.{item.name}", skip_self=True)
                s.collective |= m.collective or bool(m.consumed)
                if item.name == "__init__":
                    s.params = m.params
                    s.internal += m.internal
                    s.feeds += m.feeds
        if s.collective:
            s.consumed = set(s.params)

    # -- notebooks ------------------------------------------------------------------------------------------
    def scan_notebook(self, nb):
        """{cell index: {"errors": [...], "notes": [...]}} for the %%ddp cells that would run on NCCL."""
        env = {k: Ext(v) for k, v in ALIASES.items()}
        env.update(device=DEV, rank=EMPTY, world_size=EMPTY, local_rank=EMPTY)
        found, requested = {}, "auto"
        for i, cell in enumerate(nb["cells"]):
            src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            if cell["cell_type"] != "code":
                continue
            if not src.startswith("%%ddp"):
                if re.search(r"^\s*%ddp\s+shutdown\b", src, re.M):
                    requested = "auto"  # the next %%ddp cell starts a fresh cluster, backend auto
                continue
            magic, _, body = src.partition("\n")
            asked = re.search(r"--backend[ =](\w+)", magic)
            if asked:
                requested = asked.group(1)  # the engine keeps it for the cells that follow
            gloo = requested == "gloo"
            try:
                tree = ast.parse(body)
            except SyntaxError as exc:  # a cell this check cannot read is a cell it would wave through
                raise AssertionError(f"cell {i}: the %%ddp cell does not parse, so its NCCL "
                                     f"placement cannot be checked: {exc}") from None
            errors, notes = [], []
            w = Walker(self, env, f"cell {i}", report=lambda n, msg: errors.append(msg), notes=notes,
                       gloo=gloo, line_offset=1)
            w.block(tree.body)
            w.finish_uncalled()
            if not gloo:
                found[i] = {"errors": list(dict.fromkeys(errors)), "notes": list(dict.fromkeys(notes))}
        return found


def _bind_import(env, node, mod=""):
    if isinstance(node, ast.Import):
        for a in node.names:
            if a.asname:
                env[a.asname] = Ext(a.name)
            else:
                top = a.name.split(".")[0]
                env[top] = Ext(top)
    else:
        base = node.module or ""
        if node.level:
            pkg = mod.split(".")[:-node.level] if mod else []
            base = ".".join([*pkg, base]) if base else ".".join(pkg)
        for a in node.names:
            env[a.asname or a.name] = Ext(f"{base}.{a.name}")


class Walker:
    """Walks statements in order, tracking which names hold CPU-built tensors and models ("taint")."""

    def __init__(self, scanner, env, where, report, notes=None, gloo=False, summary=False, line_offset=0,
                 depth=0, stack=(), root=None):
        self.s, self.env, self.where, self._report = scanner, env, where, report
        self.root = root or where  # the cell (or helper) being scanned; where: whose code this is
        self.notes, self.gloo, self.summary = notes, gloo, summary
        self.line_offset, self.depth, self.stack = line_offset, depth, stack
        self.consumed, self.returns, self.collective, self.feeds = set(), EMPTY, False, []
        self.defined, self.called = [], set()

    def report(self, node, msg):
        if not self.gloo:
            self._report(node, f"{self.where}, line {node.lineno + self.line_offset}: {msg}")

    # -- statements -----------------------------------------------------------------------------------------
    def block(self, stmts):
        for st in stmts:
            self.stmt(st)

    def branch(self, stmts, gloo=False):
        saved_env, saved_gloo = self.env, self.gloo
        self.env, self.gloo = dict(saved_env), saved_gloo or gloo
        try:
            self.block(stmts)
            return self.env
        finally:
            self.env, self.gloo = saved_env, saved_gloo

    def merge(self, *envs):
        for key in set().union(*envs):
            vals = [e[key] for e in envs if key in e]
            if all(isinstance(v, frozenset) for v in vals):
                self.env[key] = _join(*vals)
            else:
                self.env[key] = vals[-1]

    def stmt(self, st):
        if isinstance(st, (ast.Import, ast.ImportFrom)):
            _bind_import(self.env, st)
        elif isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
            self.env[st.name] = f = Func(st, self.where)
            self.defined.append(f)
        elif isinstance(st, ast.ClassDef):
            is_module = any("Module" in ast.unparse(b) for b in st.bases)
            collective = any(isinstance(n, ast.Call) and self.sink_name(n.func) for n in ast.walk(st))
            self.env[st.name] = Cls(st, is_module, collective)
            for item in st.body:  # methods: sinks on CPU tensors they build themselves
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    self.call_local(Func(item, self.where), [], {}, st, skip_self=True)
        elif isinstance(st, ast.Assign):
            v = self.expr(st.value)
            for t in st.targets:
                self.bind(t, v, st.value)
        elif isinstance(st, ast.AnnAssign) and st.value is not None:
            self.bind(st.target, self.expr(st.value), st.value)
        elif isinstance(st, ast.AugAssign):
            v = self.expr(st.value)
            if isinstance(st.target, ast.Name):  # in place: a tensor keeps its device
                old = self.env.get(st.target.id, EMPTY)
                self.env[st.target.id] = old if _taint(old) else _taint(v)
        elif isinstance(st, (ast.For, ast.AsyncFor)):
            it = self.expr(st.iter)
            for _ in range(2):  # twice: what one iteration assigns, the next one uses
                self.bind(st.target, _taint(it) if not isinstance(it, Func) else it, None)
                self.block(st.body)
            self.block(st.orelse)
        elif isinstance(st, ast.While):
            self.expr(st.test)
            for _ in range(2):
                self.block(st.body)
            self.block(st.orelse)
        elif isinstance(st, ast.If):
            self.expr(st.test)
            gloo_side = _gloo_test(st.test)
            a = self.branch(st.body, gloo=gloo_side == "body")
            b = self.branch(st.orelse, gloo=gloo_side == "orelse")
            if self.gloo:
                self.merge(a, b)
            else:  # on NCCL only the other branch runs: what the gloo-only one assigns does not count there
                self.merge(*[e for e, side in ((a, "body"), (b, "orelse")) if side != gloo_side])
        elif isinstance(st, (ast.With, ast.AsyncWith)):
            for item in st.items:
                v = self.expr(item.context_expr)
                if item.optional_vars is not None:
                    self.bind(item.optional_vars, _taint(v), None)
            self.block(st.body)
        elif isinstance(st, ast.Try) or type(st).__name__ == "TryStar":
            self.block(st.body)
            for h in st.handlers:
                self.block(h.body)
            self.block(st.orelse)
            self.block(st.finalbody)
        elif isinstance(st, ast.Return) and st.value is not None:
            self.returns = _join(self.returns, self.expr(st.value))
        elif isinstance(st, ast.Expr):
            v = st.value
            self.expr(v)
            if (isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and isinstance(v.func.value, ast.Name)
                    and v.func.attr in ("to", "cuda", "cpu", "to_empty")):  # model.to(device): moves the model
                self.env[v.func.value.id] = self.moved(v, self.env.get(v.func.value.id, EMPTY))
        else:
            for child in ast.iter_child_nodes(st):
                if isinstance(child, ast.expr):
                    self.expr(child)

    def bind(self, target, value, value_node):
        if isinstance(target, ast.Name):
            self.env[target.id] = value
        elif isinstance(target, (ast.Tuple, ast.List)):
            elts = getattr(value_node, "elts", None)
            if (isinstance(value_node, (ast.Tuple, ast.List)) and len(elts) == len(target.elts)
                    and not any(isinstance(e, ast.Starred) for e in elts)):
                for t, e in zip(target.elts, elts):  # a, b = x.to(device), torch.zeros(3): one by one
                    self.bind(t, self.expr(e), e)
            else:
                for t in target.elts:
                    self.bind(t.value if isinstance(t, ast.Starred) else t, _taint(value), None)

    def finish_uncalled(self):
        """A function defined here and never called here: checked with the notebook's same-named values."""
        for f in self.defined:
            if id(f.node) not in self.called:
                kwargs = {a.arg: self.env.get(a.arg, EMPTY) for a in (*f.node.args.args, *f.node.args.kwonlyargs)}
                self.call_local(f, [], {k: v for k, v in kwargs.items() if isinstance(v, frozenset)}, None)

    # -- expressions ----------------------------------------------------------------------------------------
    def qual(self, node):
        v = self.expr_quiet(node)
        return v.q if isinstance(v, Ext) else None

    def expr_quiet(self, node):
        if isinstance(node, ast.Name):
            return self.env.get(node.id, EMPTY)
        if isinstance(node, ast.Attribute):
            base = self.expr_quiet(node.value)
            return Ext(f"{base.q}.{node.attr}") if isinstance(base, Ext) else _taint(base)
        return None

    def sink_name(self, func):
        """'collective', 'wrapper' or None for the callee ``func`` (an expression)."""
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        q = self.qual(func) if isinstance(func, (ast.Name, ast.Attribute)) else None
        if name in WRAPPERS or (q and q.split(".")[-1] in WRAPPERS):
            return "wrapper"
        if name in COLLECTIVES and (q is None or q.startswith("torch.distributed") or q.endswith(f"dist.{name}")):
            if isinstance(func, ast.Attribute) and q is None:
                return None  # a method of some object that happens to be called like a collective
            return "collective"
        return None

    def devtaint(self, node):
        """Where a device argument (``device=...``, ``.to(...)``) puts a tensor: CPU, DEV, arg tags, or None
        when it is not a device (a dtype)."""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return CPU if node.value == "cpu" else DEV
        if isinstance(node, ast.Constant) and node.value is None:
            return CPU
        v = self.expr(node)
        if isinstance(v, Ext):
            return None  # torch.float16 and friends
        t = frozenset(x for x in _taint(v) if x in ("cpu", "dev") or x.startswith("arg:"))
        if t:
            return t
        if isinstance(node, ast.Name) and ("dtype" in node.id):
            return None
        return DEV  # an expression we cannot read: assume the author meant a device

    def moved(self, call, base):
        f = call.func.attr
        if f == "cuda":
            return DEV
        if f == "cpu":
            return CPU
        for kw in call.keywords:
            if kw.arg == "device":
                return self.devtaint(kw.value) or base
        if f in ("to", "to_empty") and call.args:
            return self.devtaint(call.args[0]) or _taint(base)
        return _taint(base)

    def expr(self, node):
        if node is None:
            return EMPTY
        if isinstance(node, ast.Name):
            return self.env.get(node.id, EMPTY)
        if isinstance(node, ast.Constant):
            return EMPTY
        if isinstance(node, ast.Attribute):
            base = self.expr(node.value)
            if isinstance(base, Ext):
                return Ext(f"{base.q}.{node.attr}")
            return _taint(base) if node.attr not in ("shape", "dtype", "is_cuda", "ndim") else EMPTY
        if isinstance(node, ast.Subscript):
            self.expr(node.slice)
            return _taint(self.expr(node.value))  # x_dev[idx_cpu] is on the device
        if isinstance(node, ast.Call):
            return self.call(node)
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            return _join(*(self.expr(e) for e in node.elts))
        if isinstance(node, ast.Dict):
            for k in node.keys:
                self.expr(k)
            return _join(*(self.expr(v) for v in node.values))
        if isinstance(node, ast.Starred):
            return _taint(self.expr(node.value))
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            saved = self.env
            self.env = dict(saved)
            try:
                for gen in node.generators:
                    self.bind(gen.target, _taint(self.expr(gen.iter)), None)
                    for cond in gen.ifs:
                        self.expr(cond)
                if isinstance(node, ast.DictComp):
                    self.expr(node.key)
                    return _taint(self.expr(node.value))
                return _taint(self.expr(node.elt))
            finally:
                self.env = saved
        if isinstance(node, ast.NamedExpr):
            v = self.expr(node.value)
            self.bind(node.target, v, node.value)
            return v
        if isinstance(node, (ast.Yield, ast.YieldFrom)):
            self.returns = _join(self.returns, self.expr(node.value))
            return EMPTY
        if isinstance(node, ast.Lambda):
            return EMPTY
        if isinstance(node, (ast.JoinedStr, ast.FormattedValue)):
            for child in ast.iter_child_nodes(node):
                self.expr(child)
            return EMPTY
        if isinstance(node, ast.IfExp):
            self.expr(node.test)
            return _join(self.expr(node.body), self.expr(node.orelse))
        if isinstance(node, ast.Compare):
            return _join(self.expr(node.left), *(self.expr(c) for c in node.comparators))
        return _join(*(self.expr(c) for c in ast.iter_child_nodes(node) if isinstance(c, ast.expr)))

    def check(self, node, what, arg, taint):
        """A sink got ``arg`` (an expression) with ``taint``."""
        self.collective = True
        if self.gloo:
            return
        if _is_cpu_only(taint):
            self.report(node, f"{what} gets `{ast.unparse(arg)}`, built on the CPU (NCCL needs it on `device`)")
        for tag in taint:
            if tag.startswith("arg:"):
                self.consumed.add(tag[4:])

    def bound_args(self, call):
        """(positional argument expressions, {keyword: expression}) of a call, ``*x``/``**x`` left out."""
        pos = [a for a in call.args if not isinstance(a, ast.Starred)]
        kws = {k.arg: k.value for k in call.keywords if k.arg is not None}
        return pos, kws

    def call(self, call):
        func = call.func
        pos, kws = self.bound_args(call)
        argtaints = [self.expr(a) for a in call.args] + [self.expr(k.value) for k in call.keywords]
        sink = self.sink_name(func) if isinstance(func, (ast.Name, ast.Attribute)) else None
        if sink == "collective":
            name = func.attr if isinstance(func, ast.Attribute) else func.id
            positions = COLLECTIVES[name]
            for i, a in enumerate(pos):
                if i in positions:
                    self.check(call, f"dist.{name}", a, _taint(self.expr_cached(a)))
            for k, a in kws.items():
                if k in TENSOR_KEYWORDS:
                    self.check(call, f"dist.{name}", a, _taint(self.expr_cached(a)))
            return EMPTY
        if sink == "wrapper":
            name = func.attr if isinstance(func, ast.Attribute) else func.id
            args = pos[:1] + [a for k, a in kws.items() if k in ("module", "params")]
            for a in args:
                self.check(call, name, a, _taint(self.expr_cached(a)))
            return _join(*(self.expr_cached(a) for a in args))

        callee = self.expr(func)
        if isinstance(func, ast.Attribute) and isinstance(callee, frozenset):  # a method of a tracked value
            base = self.expr(func.value)
            if func.attr in ("to", "cuda", "cpu", "to_empty"):
                return self.moved(call, base)
            if "device" in kws:
                return self.devtaint(kws["device"]) or _taint(base)
            if func.attr in ("item", "tolist", "numel", "size", "dim", "element_size", "nelement", "wait",
                             "is_completed", "numpy", "get_future"):
                return EMPTY
            return _taint(base)
        if isinstance(callee, Func):
            return self.call_local(callee, pos, {k: self.expr_cached(v) for k, v in kws.items()}, call)
        if isinstance(callee, Cls):
            if callee.collective:
                for a in [*pos, *kws.values()]:
                    self.check(call, callee.node.name, a, _taint(self.expr_cached(a)))
            if "device" in kws:
                return self.devtaint(kws["device"]) or DEV
            if callee.is_module:
                return self.fresh_module(call, argtaints)
            return EMPTY
        if isinstance(callee, Ext):
            return self.call_ext(call, callee.q, pos, kws, argtaints)
        if self.summary and isinstance(func, ast.Name) and f"arg:{func.id}" in _taint(callee):
            for a in [*pos, *kws.values()]:  # a helper calls a function it was given: that may all-reduce
                if _is_cpu_only(_taint(self.expr(a))) and not self.gloo:
                    self.feeds.append((func.id, f"{self.where}, line {call.lineno + self.line_offset}: it hands "
                                                f"`{ast.unparse(a)}`, built on the CPU, to `{func.id}`"))
            return _join(*argtaints)
        return _join(callee, *argtaints)  # calling a model: its output lives where the model and inputs do

    def expr_cached(self, node):
        return self.expr(node)

    def fresh_module(self, call, argtaints):
        """An nn.Module built here: on the device only if it wraps something that is (DDP-like wrappers,
        ``nn.Sequential`` of moved layers); otherwise its parameters are made on the CPU."""
        t = _join(*argtaints)
        if "dev" in t:
            return t
        if "cpu" not in t:
            self.built(call, "an nn.Module")
        return t | CPU

    def built(self, call, what):
        if self.notes is not None and not self.gloo and self.where == self.root:
            self.notes.append(f"{self.where}, line {call.lineno + self.line_offset}: {what} built on the CPU: "
                              f"`{ast.unparse(call)[:80]}`")
        return CPU

    def call_ext(self, call, q, pos, kws, argtaints):
        parts = q.split(".")
        last = parts[-1]
        if q == "torch.device":
            return self.devtaint(pos[0]) if pos else DEV
        if parts[0] == "torch" and len(parts) == 2 and last in TENSOR_CTORS:
            if "device" in kws:
                return self.devtaint(kws["device"]) or DEV
            return self.built(call, "a tensor")
        if parts[0] == "torch" and len(parts) == 2 and last in LIKE_CTORS:
            if "device" in kws:
                return self.devtaint(kws["device"]) or DEV
            return _taint(self.expr(pos[0])) if pos else EMPTY
        if q.startswith("torch.nn.") and last[:1].isupper() and "functional" not in parts:
            if "device" in kws:
                return self.devtaint(kws["device"]) or DEV
            return self.fresh_module(call, argtaints)
        if q.startswith("course_utils"):
            s = self.s.summary(q)
            if s is not None:
                return self.apply_summary(call, q, s, pos, kws, argtaints)
        return _join(*argtaints)

    def apply_summary(self, call, q, s, pos, kws, argtaints):
        short = q.split(".")[-1]
        if s.internal and not self.gloo:
            self.report(call, f"`{short}` builds CPU tensors for collectives itself ({s.internal[0]})")
        if s.collective:
            self.collective = True
        bound = {}
        for i, a in enumerate(pos):
            if i < len(s.params):
                bound[s.params[i]] = a
        bound.update({k: v for k, v in kws.items() if k in s.params or not s.params})
        for p, text in s.feeds:  # only a problem if the function given to it runs collectives on its arguments
            given = self.expr(bound[p]) if p in bound else None
            if (isinstance(given, Func) and self.consumes(given)) or (
                    isinstance(given, Ext) and getattr(self.s.summary(given.q), "consumed", None)):
                self.report(call, f"`{short}` calls `{ast.unparse(bound[p])}`, which runs collectives on its "
                                  f"arguments, with CPU tensors ({text})")
        for p in s.consumed:
            if p in bound:
                self.check(call, f"`{short}` (its `{p}`)", bound[p], _taint(self.expr_cached(bound[p])))
        if "device" in kws:
            return self.devtaint(kws["device"]) or DEV
        out = set()
        for tag in s.returns:
            if tag.startswith("arg:"):
                p = tag[4:]
                out |= _taint(self.expr(bound[p])) if p in bound else set()
            else:
                out.add(tag)
        if s.is_module:
            return self.fresh_module(call, [frozenset(out)] + argtaints)
        return frozenset(out)

    def consumes(self, f):
        """Does the local function ``f`` hand one of its arguments to a collective or DDP?"""
        local = dict(self.env)
        for a in (*f.node.args.posonlyargs, *f.node.args.args, *f.node.args.kwonlyargs):
            local[a.arg] = frozenset({f"arg:{a.arg}"})
        w = Walker(self.s, local, self.where, lambda _n, _m: None, summary=True, depth=self.depth + 1,
                   stack=(*self.stack, id(f.node)), root=self.root)
        w.block(f.node.body)
        return bool(w.consumed)

    def call_local(self, f, pos_nodes, kw_taints, call, skip_self=False):
        """Run a function of the cell (or of an earlier cell) with its arguments' taint: its return taint."""
        node = f.node
        key = id(node)
        self.called.add(key)
        if key in self.stack or self.depth > 5:
            return EMPTY
        local = dict(self.env)
        params = [a.arg for a in (*node.args.posonlyargs, *node.args.args)]
        if skip_self and params:
            local[params[0]] = EMPTY
            params = params[1:]
        for a in (*params, *(k.arg for k in node.args.kwonlyargs)):
            local[a] = EMPTY
        for p, a in zip(params, pos_nodes):
            local[p] = _taint(self.expr(a)) if isinstance(a, ast.AST) else a
        for k, v in kw_taints.items():
            local[k] = v
        if self.summary:  # inside a course_utils helper, unknown parameters stay the helper's own
            for p in params:
                if local.get(p, EMPTY) == EMPTY and f"arg:{p}" in _taint(self.env.get(p, EMPTY)):
                    local[p] = self.env[p]
        where = f.where if f.where == self.root else f"{f.where} (called from {self.root})"
        w = Walker(self.s, local, where, self._report, notes=self.notes, gloo=self.gloo, summary=self.summary,
                   line_offset=self.line_offset, depth=self.depth + 1, stack=(*self.stack, key), root=self.root)
        w.block(node.body)
        for g in w.defined:  # nested helpers count as called through their parent
            self.called.add(id(g.node))
        self.consumed |= w.consumed
        self.collective |= w.collective
        self.feeds += w.feeds
        return w.returns


# ---- revisions -------------------------------------------------------------------------------------------

def _reader_at(rev):
    def read(rel):
        out = subprocess.run(["git", "show", f"{rev}:{rel}"], cwd=ROOT, capture_output=True, text=True)
        return out.stdout if out.returncode == 0 else None
    return read


def _read_here(rel):
    p = ROOT / rel
    return p.read_text(encoding="utf-8") if p.is_file() else None


def scan(nb, read=_read_here):
    return Scanner(read).scan_notebook(nb)


def scan_source(*cells, read=_read_here):
    """Scan code cells given as text (each a whole cell, magic line included)."""
    nb = {"cells": [{"cell_type": "code", "source": c} for c in cells]}
    return scan(nb, read)


def _errors(found):
    return {i: r["errors"] for i, r in found.items() if r["errors"]}


# ---- the course's notebooks ------------------------------------------------------------------------------



@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_no_cpu_tensor_or_model_reaches_a_collective_in_a_cell_that_can_run_on_nccl(path):
    found = scan(json.loads(path.read_text(encoding="utf-8")))
    bad = _errors(found)
    assert not bad, (f"{path.name}: these %%ddp cells would crash on NCCL (a learner with enough GPUs gets it). "
                     "Build the tensors and models on `device`, or pin `--backend gloo` with a sentence saying "
                     "why the lesson is about the CPU there:\n" +
                     "\n".join(f"  {m}" for ms in bad.values() for m in ms))


# The cells of the lessons at OLD that crash on NCCL (0-based indices). 02: every cell that hands a tensor to a
# collective; cell 5 defines tensors only and cell 28 uses all_gather_object (no tensor), so neither fails.
OLD_FAILING = {
    "01_data_parallelism.ipynb": {8, 12, 16, 20, 25, 31},
    "02_collectives_sandbox.ipynb": {3, 8, 11, 14, 17, 20, 23, 25, 30, 32, 35, 39},
    "03_all_reduce_by_hand.ipynb": {3, 7, 11},
    "11_capstone_micro_ddp.ipynb": {3, 7, 9, 15, 18, 21, 23},
}
# 09 cells 3 and 34 at OLD construct CPU tensors too, and work on NCCL: cell 3 indexes its
# device-resident data with a CPU index from a seeded CPU generator, cell 34 draws with a CPU generator and
# moves the draws with .to(device). Both work on NCCL, so they are in the census, not among the failures.
OLD_CENSUS_ONLY = {"09_compression.ipynb": {3, 34}}


def _old(name):
    out = subprocess.run(["git", "show", f"{OLD}:notebooks/{name}"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        if in_ci():
            pytest.fail(f"commit {OLD} is not in this clone: CI needs the full history (git fetch --unshallow)")
        pytest.skip(f"commit {OLD} is not in this checkout (a shallow clone or no git): {out.stderr.strip()}")
    return json.loads(out.stdout)


@pytest.mark.parametrize("name", sorted(OLD_FAILING), ids=str)
def test_the_scan_catches_every_cell_known_to_crash_on_nccl_in_the_old_lessons(name):
    found = Scanner(_reader_at(OLD)).scan_notebook(_old(name))
    flagged = set(_errors(found))
    missed = OLD_FAILING[name] - flagged
    assert not missed, f"{name} at {OLD}: the scan let cells {sorted(missed)} through; it flagged {sorted(flagged)}"
    if name == "02_collectives_sandbox.ipynb":
        assert flagged == OLD_FAILING[name], f"02: cells 5 (no collective) and 28 (all_gather_object) are right: " \
                                             f"{sorted(flagged - OLD_FAILING[name])}"


def test_09s_old_cpu_constructions_that_work_on_nccl_are_in_the_census_not_the_errors():
    found = Scanner(_reader_at(OLD)).scan_notebook(_old("09_compression.ipynb"))
    for i in OLD_CENSUS_ONLY["09_compression.ipynb"]:
        assert found[i]["notes"], f"09 cell {i}: its CPU constructions must be in the census"
        assert any("torch.Generator" in n or "generator=g" in n for n in found[i]["notes"]), found[i]["notes"]
        assert not found[i]["errors"], f"09 cell {i} gives collectives nothing built on the CPU: {found[i]['errors']}"


def test_the_old_messages_name_the_collective_and_the_cpu_value():
    found = Scanner(_reader_at(OLD)).scan_notebook(_old("02_collectives_sandbox.ipynb"))
    assert "dist.all_reduce gets `tensor`, built on the CPU" in found[3]["errors"][0], found[3]["errors"]
    found = Scanner(_reader_at(OLD)).scan_notebook(_old("11_capstone_micro_ddp.ipynb"))
    assert any("check_start_allreduce" in m for m in found[9]["errors"]), \
        f"11 cell 9's only CPU tensor is built inside the checker: {found[9]['errors']}"


# ---- the rule on small cells: what it must catch, and what it must let through -----------------------

CAUGHT = {
    "a CPU tensor to all_reduce": "%%ddp -n 2\nimport torch\nt = torch.ones(1) * rank\ndist.all_reduce(t)",
    "a CPU model to DDP": "%%ddp\nfrom course_utils.models import make_model\nmodel = DDP(make_model(seed=0))",
    "gradients of a CPU model": "%%ddp\nnet = torch.nn.Linear(4, 1)\nfor p in net.parameters():\n"
                                "    dist.all_reduce(p.grad)",
    "a list of CPU slots": "%%ddp\nx = torch.zeros(3, device=device)\nout = [torch.zeros(3) for _ in range(2)]\n"
                           "dist.all_gather(out, x)",
    "through a local function": "%%ddp\ndef start():\n    return torch.arange(3.) + rank\nx = start()\n"
                                "dist.broadcast(x, src=0)",
    "a function handed to a helper": "%%ddp\nmodel = torch.nn.Linear(2, 2)\ndef avg(model):\n"
                                     "    for p in model.parameters():\n        dist.all_reduce(p.grad)\n",
    "moved only on the gloo side": "%%ddp\nt = torch.ones(2)\nif dist.get_backend() == 'nccl':\n"
                                   "    pass\nelse:\n    t = t.to(device)\ndist.all_reduce(t)",
    "a course_utils helper that sends its argument": "%%ddp --backend nccl\n"
                                                     "from course_utils.allreduce import ring_all_reduce\n"
                                                     "ring_all_reduce(torch.arange(4.))",
    "a CPU model moved back": "%%ddp\nm = torch.nn.Linear(2, 2).to(device)\nm.cpu()\nDDP(m)",
    "isend of a CPU draw": "%%ddp\nreq = dist.isend(torch.randn(3), dst=1)",
}
PASSES = {
    "built on device": "%%ddp\nt = torch.ones(1, device=device) * rank\ndist.all_reduce(t)",
    "moved to device": "%%ddp\nt = torch.randn(4, generator=torch.Generator().manual_seed(0)).to(device)\n"
                       "dist.all_reduce(t)",
    "model moved by a statement": "%%ddp\nfrom course_utils.models import make_model\nmodel = make_model(0)\n"
                                  "model.to(device)\nddp = DDP(model)\nfor p in ddp.parameters():\n"
                                  "    dist.broadcast(p, 0)",
    "a gloo-only branch": "%%ddp\nif dist.get_backend() == 'gloo':\n    t = torch.ones(1)\n    dist.all_reduce(t)",
    "a backend-aware device": "%%ddp\ndev = torch.device('cuda', local_rank) if dist.get_backend() == 'nccl' "
                              "else torch.device('cpu')\nt = torch.zeros(2, device=dev)\ndist.all_reduce(t)",
    "objects and barriers": "%%ddp\nout = [None] * world_size\ndist.all_gather_object(out, {'r': rank})\n"
                            "dist.barrier()\nx = torch.ones(3)  # CPU, but no collective sees it\nprint(x)",
    "zeros_like of a device tensor": "%%ddp\nx = torch.arange(4., device=device)\nbuf = torch.empty_like(x)\n"
                                     "dist.all_to_all_single(buf, x)",
    "an earlier cell's device data": "%%ddp\nx = torch.ones(3).to(device)",
    "CPU index into device data": "%%ddp\nidx = torch.randint(0, 3, (2,))\nt = x[idx]\ndist.all_reduce(t)",
}


@pytest.mark.parametrize("case", sorted(CAUGHT), ids=str)
def test_the_rule_catches(case):
    found = scan_source(CAUGHT[case])
    assert found[0]["errors"], f"{case}: not caught"


def test_the_rule_lets_correct_cells_through():
    cells = [PASSES[k] for k in PASSES]
    found = scan_source(*cells)
    wrong = {list(PASSES)[i]: r["errors"] for i, r in found.items() if r["errors"]}
    assert not wrong, f"false positives: {wrong}"
    assert found[list(PASSES).index("objects and barriers")]["notes"], "the census lists harmless CPU tensors too"


def test_a_ddp_cell_that_does_not_parse_fails_the_scan_instead_of_being_skipped():
    with pytest.raises(AssertionError, match=r"cell 1: the %%ddp cell does not parse"):
        scan_source("x = 1", "%%ddp\nimport torch\nt = torch.ones(3\ndist.all_reduce(t)")


def test_a_course_utils_module_that_does_not_parse_fails_the_scan_instead_of_being_skipped():
    files = {"course_utils/fake_checks.py": "import torch\n\ndef check_avg(fn:\n    fn(torch.arange(6.))\n"}
    with pytest.raises(AssertionError, match=r"course_utils\.fake_checks does not parse"):
        scan_source("%%ddp\nfrom course_utils.fake_checks import check_avg\n"
                    "def f(flat):\n    return dist.all_reduce(flat)\ncheck_avg(f)", read=lambda rel: files.get(rel))


def test_backend_gloo_pins_the_cell_and_the_cells_after_it_until_a_shutdown_or_another_backend():
    cpu = "%%ddp\nt = torch.ones(1)\ndist.all_reduce(t)"
    found = scan_source(cpu, "%%ddp -n 4 --backend gloo\nt = torch.ones(1)\ndist.all_reduce(t)", cpu,
                        "%%ddp -n 2\nx = 1", cpu,  # a new size keeps the backend (the engine's rule)
                        "%ddp shutdown", cpu, "%%ddp --backend gloo\nx = 1", cpu, "%%ddp --backend auto\nx = 1", cpu)
    scanned = {i for i in found}
    assert scanned == {0, 6, 9, 10}, f"cells scanned as possibly NCCL: {sorted(scanned)}"
    assert {i for i, r in found.items() if r["errors"]} == {0, 6, 10}


def test_a_checker_that_builds_cpu_tensors_for_the_learners_function_fails_its_callers(tmp_path):
    checker = ("import torch\nimport torch.distributed as dist\n\n"
               "def check_avg(fn):\n    flat = torch.arange(6.)\n    work = fn(flat)\n\n"
               "def check_avg_fixed(fn, device=None):\n"
               "    dev = torch.device('cuda', torch.cuda.current_device()) if dist.get_backend() == 'nccl' "
               "else torch.device('cpu')\n    fn(torch.arange(6., device=dev))\n")
    files = {"course_utils/fake_checks.py": checker}
    found = scan_source("%%ddp\nfrom course_utils.fake_checks import check_avg\n"
                        "def f(flat):\n    return dist.all_reduce(flat, async_op=True)\ncheck_avg(f)",
                        "%%ddp\nfrom course_utils.fake_checks import check_avg_fixed\ncheck_avg_fixed(f)",
                        "%%ddp\ndef layout(flat):\n    return [flat.numel()]  # no collective\ncheck_avg(layout)",
                        read=lambda rel: files.get(rel))
    assert any("check_avg" in m and "flat" in m for m in found[0]["errors"]), found[0]
    assert not found[1]["errors"], found[1]
    assert not found[2]["errors"], f"a CPU tensor for a function that runs no collective is fine: {found[2]}"


def test_the_scan_reads_the_course_utils_of_the_notebooks_own_revision():
    read = _reader_at(OLD)
    if read("course_utils/checks/micro_ddp.py") is None:
        pytest.skip(f"commit {OLD} is not in this checkout")
    s = Scanner(read).summary("course_utils.checks.check_start_allreduce")
    assert s is not None and s.feeds, "the old check_start_allreduce gave the learner's function a CPU bucket"
    s = Scanner(read).summary("course_utils.allreduce.ring_all_reduce")
    assert s is not None and "tensor" in s.consumed, "ring_all_reduce sends its argument"
    s = Scanner(read).summary("course_utils.micro_ddp.MicroDDP")
    assert s is not None and s.collective and "module" in s.consumed, "MicroDDP all-reduces its module's grads"


def _report_current():  # pragma: no cover  (a helper for engineers: python tests/test_nccl_cells.py)
    for path in LESSONS:
        for i, ms in _errors(scan(json.loads(path.read_text(encoding="utf-8")))).items():
            for m in ms:
                print(f"{path.name} {m}")


if __name__ == "__main__":  # pragma: no cover
    _report_current()

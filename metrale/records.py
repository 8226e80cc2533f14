"""Signed benchmark records: canonical JSON, provenance stamped in, a detached ed25519 signature.

A record is the JSON a perf/ harness writes into perf/results/. `finish(path, harness=__file__)`
stamps the provenance fields a record lacks (commit, date, device, driver, harness,
harness_sha256) and, when a signing key is configured, writes `<record>.sig` next to it:

    {"alg": "ed25519", "key_id": "<16 hex>", "signature": "<base64>"}

The signature covers `canonical(json.load(record))`, not the file's bytes: the file stays
human-readable (indent=1). So an edit that changes the parsed JSON (one digit, a key, a string)
fails verification, while whitespace, key order and other spellings of the same value
(`1.0` / `1.00`, `"\\u00e9"` / `"é"`) do not. Duplicate keys, NaN and infinity are refused.

Keys: the private key comes from METRALE_SIGNING_KEY_FILE (a PEM PKCS#8 or raw 32-byte ed25519
private key, never inside the repository) or METRALE_SIGNING_KEY (base64 of the raw 32 bytes).
Public keys are committed as perf/keys/<key_id>.pub (base64 of the raw 32 bytes and a newline);
key_id is the first 16 hex digits of the raw public key's sha256.

    python -m metrale.records verify RECORD [RECORD ...] | --all
    python -m metrale.records sign RECORD [RECORD ...]
    python -m metrale.records keygen PRIVATE_KEY_PATH

`cryptography` (the `test` extra) is imported only where a signature is made or checked:
serving never needs it.
"""
from __future__ import annotations

import argparse
import base64
import binascii
import collections
import datetime
import hashlib
import json
import logging
import math
import os
import platform
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from metrale import levers

log = logging.getLogger("metrale.records")

ROOT = Path(__file__).resolve().parents[1]     # the checkout: harness paths are relative to it
KEYS_DIR = ROOT / "perf" / "keys"
RESULTS_DIR = ROOT / "perf" / "results"
NO_KEY = "unsigned: no signing key (set METRALE_SIGNING_KEY_FILE)"
NO_KEY_HELP = ("no signing key: set METRALE_SIGNING_KEY_FILE (a PEM or raw 32-byte ed25519 "
               "private key outside the repository) or METRALE_SIGNING_KEY (base64 of the raw "
               "32 bytes)")
_KEY_ID = re.compile(r"[0-9a-f]{16}")


class RecordError(ValueError):
    """A record, signature or key that cannot be used; the message says what to do."""


# ---- canonical form and provenance --------------------------------------------------------------

def canonical(record: dict) -> bytes:
    """The bytes a signature covers: sorted keys, no whitespace, UTF-8, floats as Python's repr."""
    bad = _nonfinite(record, "record")
    if bad:
        raise RecordError(f"canonical JSON has no NaN or infinity, but {bad}: "
                          "record a finite number, or null for a missing figure")
    text = json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RecordError(f"record holds a string that is not valid Unicode ({e})") from None


def _nonfinite(value, where: str) -> str | None:
    if isinstance(value, float) and not math.isfinite(value):
        return f"{where} is {value!r}"
    items = value.items() if isinstance(value, dict) else (
        enumerate(value) if isinstance(value, (list, tuple)) else ())
    for key, item in items:
        bad = _nonfinite(item, f"{where}[{key!r}]")
        if bad:
            return bad
    return None


def load_record(path: Path) -> dict:
    """A record file parsed strictly: a JSON object, no duplicate keys, no NaN / Infinity."""
    def pairs(items):
        dups = sorted(k for k, n in collections.Counter(k for k, _ in items).items() if n > 1)
        if dups:
            raise RecordError(f"{path}: duplicate key(s) {dups}: a reader and the parser "
                              "would see different values")
        return dict(items)

    def constant(name):
        raise RecordError(f"{path}: {name} is not JSON: record a finite number or null")

    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"), object_pairs_hook=pairs,
                            parse_constant=constant)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RecordError(f"{path}: not a readable JSON record ({e})") from None
    if not isinstance(record, dict):
        raise RecordError(f"{path}: a record is a JSON object, got {type(record).__name__}")
    return record


def stamp(record: dict, harness_path, *, root: Path | None = None) -> dict:
    """The record with the provenance fields it lacks added (those it has are kept as given)."""
    root = Path(root or ROOT).resolve()
    out = dict(record)
    if "commit" not in out:
        out["commit"] = _commit(root)
    out.setdefault("date", datetime.datetime.now(datetime.timezone.utc).isoformat())
    if "device" not in out:
        out["device"] = _nvidia_smi("name") or f"cpu ({platform.machine()})"
    if "driver" not in out:
        out["driver"] = _nvidia_smi("driver_version") or "none"
    if "harness_sha256" not in out:
        out.setdefault("harness", _relative(Path(harness_path), root))
        out["harness_sha256"] = _sha256(root, out["harness"])
    return out


def _commit(root: Path) -> str:
    if os.environ.get("GIT_COMMIT"):       # the GPU machine's .git is stale: DEVELOPERS.md
        return os.environ["GIT_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=root, text=True,
                                       stderr=subprocess.DEVNULL, timeout=10).strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _nvidia_smi(query: str) -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else None


def _relative(path: Path, root: Path) -> str:
    try:
        return path.resolve().relative_to(root).as_posix()
    except ValueError:
        raise RecordError(f"harness {path} is not inside the repository {root}: a record names "
                          "the committed script that wrote it") from None


def _in_tree(root: Path, rel: str) -> Path | None:
    """root/rel if that stays inside root, else None."""
    try:
        path = (root / rel).resolve()
    except (OSError, ValueError):          # a NUL byte, a symlink loop
        return None
    return path if path == root or root in path.parents else None


def _sha256(root: Path, rel: str) -> str:
    path = _in_tree(root, rel)
    if path is None or not path.is_file():
        raise RecordError(f"harness {rel!r} is not a file inside the repository {root}")
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---- keys -----------------------------------------------------------------------------------------

def _crypto():
    try:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise RecordError("signing and verifying records needs the cryptography package: "
                          "pip install 'cryptography>=42' (it is in metrale's `test` extra)") from None
    return ed25519, serialization, InvalidSignature


def _raw_public(public_key) -> bytes:
    _, serialization, _ = _crypto()
    return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(public_key) -> str:
    """First 16 hex digits of the sha256 of the raw 32-byte public key."""
    return hashlib.sha256(_raw_public(public_key)).hexdigest()[:16]


def _refuse_inside_repo(path: Path, what: str) -> None:
    resolved, root = Path(path).expanduser().resolve(), ROOT.resolve()
    if resolved == root or root in resolved.parents:
        raise RecordError(f"{what} {path} is inside the repository ({root}): a private key there "
                          "is one `git add` away from being published. Keep it outside the "
                          "checkout, e.g. ~/.config/metrale/signing.pem")


def _private_from_raw(raw: bytes, what: str):
    ed25519, _, _ = _crypto()
    if len(raw) != 32:
        raise RecordError(f"{what}: an ed25519 private key is 32 raw bytes, got {len(raw)}")
    return ed25519.Ed25519PrivateKey.from_private_bytes(raw)


def _private_from_file(path: Path):
    _refuse_inside_repo(path, "METRALE_SIGNING_KEY_FILE")
    ed25519, serialization, _ = _crypto()
    try:
        data = Path(path).expanduser().read_bytes()
    except OSError as e:
        raise RecordError(f"METRALE_SIGNING_KEY_FILE: cannot read {path} ({e})") from None
    if not data.lstrip().startswith(b"-----BEGIN"):
        return _private_from_raw(data, f"METRALE_SIGNING_KEY_FILE {path} (not PEM)")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as e:
        raise RecordError(f"METRALE_SIGNING_KEY_FILE {path}: not an unencrypted PEM private "
                          f"key ({e})") from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise RecordError(f"METRALE_SIGNING_KEY_FILE {path}: a {type(key).__name__}, not ed25519")
    return key


def _b64decode(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise RecordError(f"{what}: not base64") from None


def load_signing_key():
    """The configured ed25519 private key, or None when neither signing lever is set."""
    path, b64 = levers.get("METRALE_SIGNING_KEY_FILE"), levers.get("METRALE_SIGNING_KEY")
    if path and b64:
        raise RecordError("both METRALE_SIGNING_KEY_FILE and METRALE_SIGNING_KEY are set: "
                          "set one, so that which key signed is not a guess")
    if path:
        return _private_from_file(Path(path))
    if b64:
        return _private_from_raw(_b64decode(b64, "METRALE_SIGNING_KEY"), "METRALE_SIGNING_KEY")
    return None


def generate_key(path, *, keys_dir: Path | None = None) -> str:
    """A new private key written to `path` (PEM, mode 0600, outside the repository) and its public
    key to keys_dir/<key_id>.pub (commit that one). Returns the key id."""
    ed25519, serialization, _ = _crypto()
    path = Path(path).expanduser()
    _refuse_inside_repo(path, "private key path")
    key = ed25519.Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise RecordError(f"{path} exists: not overwriting a private key") from None
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(pem)
    kid = key_id(key.public_key())
    keys_dir = Path(keys_dir or KEYS_DIR)
    keys_dir.mkdir(parents=True, exist_ok=True)
    (keys_dir / f"{kid}.pub").write_text(
        base64.b64encode(_raw_public(key.public_key())).decode() + "\n")
    return kid


def _public_key(kid: str, keys_dir: Path):
    """The public key perf/keys/<kid>.pub holds, or None when there is no such file."""
    ed25519, _, _ = _crypto()
    file = keys_dir / f"{kid}.pub"
    if not file.is_file():
        return None
    raw = _b64decode(file.read_text(), str(file))
    if len(raw) != 32:
        raise RecordError(f"{file}: an ed25519 public key is 32 raw bytes, got {len(raw)}")
    public = ed25519.Ed25519PublicKey.from_public_bytes(raw)
    if key_id(public) != kid:
        raise RecordError(f"{file} holds key {key_id(public)}, not {kid}: rename or replace it")
    return public


# ---- signing and verifying -----------------------------------------------------------------------

def signature_path(record_path) -> Path:
    return Path(f"{record_path}.sig")


def sign(record_path, key=None, *, keys_dir: Path | None = None) -> Path:
    """Write <record>.sig: ed25519 over canonical(the parsed record). `key`: an
    Ed25519PrivateKey; None = the configured one. Refused when the key's public half is not in
    keys_dir (verify would say "unknown key")."""
    key = key or load_signing_key()
    if key is None:
        raise RecordError(NO_KEY_HELP)
    keys_dir = Path(keys_dir or KEYS_DIR)
    kid = key_id(key.public_key())
    if _public_key(kid, keys_dir) is None:
        raise RecordError(f"the signing key's public key {kid} is not in {keys_dir}: add "
                          f"{kid}.pub there (generate_key writes it) and commit it")
    payload = canonical(load_record(Path(record_path)))
    sig = {"alg": "ed25519", "key_id": kid,
           "signature": base64.b64encode(key.sign(payload)).decode()}
    out = signature_path(record_path)
    out.write_text(json.dumps(sig, indent=1) + "\n")
    return out


@dataclass
class Verdict:
    ok: bool
    reasons: list[str] = field(default_factory=list)
    signed: bool = True

    @property
    def line(self) -> str:
        if not self.signed:
            return "unsigned (legacy)"
        return "ok" if self.ok else "FAILED: " + "; ".join(self.reasons)


def verify(record_path, *, root: Path | None = None, keys_dir: Path | None = None) -> Verdict:
    """Check, in order: the .sig exists, its key is in keys_dir, the signature covers the record
    as it parses now, and the harness file still hashes to harness_sha256."""
    path = Path(record_path)
    if not path.is_file():
        return Verdict(False, [f"record missing: {path}"])
    if not signature_path(path).is_file():
        return Verdict(False, ["unsigned (legacy record)"], signed=False)
    try:
        sig = _load_signature(signature_path(path))
        record = load_record(path)
        reasons = _signature_reasons(sig, canonical(record), Path(keys_dir or KEYS_DIR))
    except RecordError as e:
        return Verdict(False, [str(e)])
    reasons += _harness_reasons(record, Path(root or ROOT).resolve())
    return Verdict(not reasons, reasons)


def _load_signature(path: Path) -> dict:
    try:
        sig = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RecordError(f"signature file {path.name} is not readable JSON ({e})") from None
    if not isinstance(sig, dict) or sig.get("alg") != "ed25519":
        raise RecordError(f"signature file {path.name}: alg must be ed25519")
    if not isinstance(sig.get("key_id"), str) or not _KEY_ID.fullmatch(sig["key_id"]):
        raise RecordError(f"signature file {path.name}: key_id must be 16 lowercase hex digits")
    sig["raw"] = _b64decode(str(sig.get("signature", "")), f"signature file {path.name}")
    return sig


def _signature_reasons(sig: dict, payload: bytes, keys_dir: Path) -> list[str]:
    _, _, InvalidSignature = _crypto()
    public = _public_key(sig["key_id"], keys_dir)
    if public is None:
        return [f"unknown key {sig['key_id']}: no {sig['key_id']}.pub in {keys_dir}"]
    try:
        public.verify(sig["raw"], payload)
    except InvalidSignature:
        return ["signature does not match: the record was changed after signing"]
    return []


def _harness_reasons(record: dict, root: Path) -> list[str]:
    want, rel = record.get("harness_sha256"), record.get("harness")
    if want is None:
        return []
    if not isinstance(rel, str):
        return ["harness_sha256 without a harness path"]
    file = _in_tree(root, rel)
    if file is None or not file.is_file():
        return [f"harness missing from the tree: {rel}"]
    if hashlib.sha256(file.read_bytes()).hexdigest() != want:
        return [f"harness changed since the record: {rel}"]
    return []


def write(path, record: dict, harness) -> Path:
    """A harness's record to `path` (its folder made), finished (stamped, signed when a key
    is configured); prints where it went."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1), encoding="utf-8")
    finish(path, harness=harness)
    print(f"wrote {path}")
    return path


def finish(path, harness, *, root: Path | None = None, keys_dir: Path | None = None) -> Path:
    """What a harness calls after writing a record: stamp the provenance it lacks (the file is
    rewritten, indent=1), then sign it when a key is configured."""
    path = Path(path)
    record = stamp(load_record(path), harness, root=root)
    canonical(record)          # refuse NaN / infinity now rather than at signing time
    path.write_text(json.dumps(record, indent=1), encoding="utf-8")
    key = load_signing_key()
    if key is None:
        log.warning(NO_KEY)
    else:
        sign(path, key, keys_dir=keys_dir)
    return path


# ---- command line -------------------------------------------------------------------------------

def register(subparsers) -> None:
    """Add `verify` and `sign` to a subparsers action; dispatch the parsed args with run(args)."""
    v = subparsers.add_parser("verify", help="check benchmark records' signatures and harnesses")
    v.add_argument("records", nargs="*", metavar="RECORD", help="record JSON files")
    v.add_argument("--all", action="store_true", help="every perf/results/*.json")
    v.set_defaults(records_command="verify")
    s = subparsers.add_parser("sign", help="sign existing records with the configured key "
                                           "(METRALE_SIGNING_KEY_FILE / METRALE_SIGNING_KEY)")
    s.add_argument("records", nargs="+", metavar="RECORD", help="record JSON files")
    s.set_defaults(records_command="sign")


def run(args) -> int:
    return {"verify": run_verify, "sign": run_sign}[args.records_command](args)


def run_verify(args) -> int:
    """One line per record: ok / unsigned (legacy) / FAILED: reason. 1 if any FAILED."""
    paths = [Path(p) for p in args.records]
    if args.all:
        paths += sorted(Path(RESULTS_DIR).glob("*.json"))
    if not paths:
        print("verify: give RECORD paths, or --all for perf/results/*.json", file=sys.stderr)
        return 2
    verdicts = [(p, verify(p)) for p in paths]
    for p, v in verdicts:
        print(f"{_shown(p)}: {v.line}")
    return 1 if any(v.signed and not v.ok for _, v in verdicts) else 0


def run_sign(args) -> int:
    try:
        key = load_signing_key()
        if key is None:
            raise RecordError(NO_KEY_HELP)
        for p in args.records:
            print(f"{_shown(Path(p))}: signed -> {_shown(sign(p, key))}")
    except RecordError as e:
        print(f"sign: {e}", file=sys.stderr)
        return 1
    return 0


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m metrale.records",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    register(sub)
    k = sub.add_parser("keygen", help="a new private key (outside the repository, 0600) and its "
                                      "public key in perf/keys/")
    k.add_argument("path", metavar="PRIVATE_KEY_PATH")
    args = parser.parse_args(argv)
    try:
        levers.check_environment()
        if args.command != "keygen":
            return run(args)
        kid = generate_key(args.path)
    except (RecordError, levers.UndeclaredLeverError) as e:
        print(f"{args.command}: {e}", file=sys.stderr)
        return 1
    print(f"key {kid}: private {args.path}, public {KEYS_DIR / (kid + '.pub')} (commit it)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

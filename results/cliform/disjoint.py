"""The entries of a manifest whose sentence no other manifest holds (the dev pool, kept apart from the study's
calibration and test sentences): python results/cliform/disjoint.py POOL OTHER... > OUT. Audio paths are
rewritten relative to OUT's folder, which is POOL's."""
import json
import sys

from tarq_deploy.data.normalize import normalized_words


def texts(path: str) -> set[str]:
    with open(path, encoding="utf-8") as handle:
        return {" ".join(normalized_words(json.loads(line)["text"])) for line in handle if line.strip()}


def main() -> None:
    pool, *others = sys.argv[1:]
    taken = set().union(*(texts(p) for p in others))
    kept = dropped = 0
    with open(pool, encoding="utf-8") as handle:
        for line in handle:
            if not line.strip():
                continue
            entry = json.loads(line)
            if " ".join(normalized_words(entry["text"])) in taken:
                dropped += 1
                continue
            kept += 1
            print(json.dumps(entry, ensure_ascii=False))
    print(f"{pool}: kept {kept}, dropped {dropped} sentences held by {', '.join(others)}", file=sys.stderr)


if __name__ == "__main__":
    main()

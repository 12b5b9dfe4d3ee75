"""The study's term list: the words WordNet 3.0 files under the topic domains medicine, law and biology (and their
sub-domains named below), read from Debian's wordnet-base. Each lemma of a synset whose topic domain (pointer ";c")
is one of those synsets is a term; underscores become spaces; lemmas with capitals, digits or other characters than
letters, spaces, hyphens and apostrophes are left out (proper names are a different question), as are lemmas of
fewer than 4 letters, and lemmas as common as everyday words: a WordNet domain also files "will", "give" and "wall"
under law or anatomy for one technical sense, so a term must have a wordfreq Zipf below MAX_ZIPF (4.0: "testimony",
"inheritance" stay; the phrase's own Zipf for a multi-word term). One term per line, sorted; the domains at the top.

    python results/terms/make_terms.py > results/terms/domain-terms.txt
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

from wordfreq import zipf_frequency

WORDNET = Path("/usr/share/wordnet")
POS_FILES = {"n": "data.noun", "v": "data.verb", "a": "data.adj", "s": "data.adj", "r": "data.adv"}
# Domains by lemma: each is the noun synset of that lemma with the most topic-domain members ("-c" pointers), e.g.
# "law" the synset of law and jurisprudence, not the practice of law.
DOMAINS = ("medicine", "law", "biology", "pathology", "surgery", "pharmacology", "anatomy", "genetics", "psychiatry",
           "criminal_law", "immunology", "physiology")
MAX_ZIPF = 4.0
TERM = re.compile(r"[a-z][a-z' -]+[a-z]")


def synset_line(pos: str, offset: str) -> str:
    with open(WORDNET / POS_FILES[pos], "rb") as f:
        f.seek(int(offset))
        return f.readline().decode("utf-8")


def lemmas_and_pointers(line: str) -> tuple[list[str], list[tuple[str, str, str]]]:
    fields = line.split(" | ")[0].split()
    count = int(fields[3], 16)
    lemmas = [fields[4 + 2 * i] for i in range(count)]
    rest = fields[4 + 2 * count:]
    pointers = [(rest[1 + 4 * i], rest[2 + 4 * i], rest[3 + 4 * i]) for i in range(int(rest[0]))]
    return lemmas, pointers


def domain_synset(lemma: str) -> str:
    """The offset of the noun synset of ``lemma`` with the most topic-domain members."""
    best, most = "", -1
    for line in (WORDNET / "data.noun").read_text(encoding="utf-8").splitlines():
        if line.startswith(" ") or f" {lemma} " not in line.split(" | ")[0]:
            continue
        lemmas, pointers = lemmas_and_pointers(line)
        members = sum(symbol == "-c" for symbol, _, _ in pointers)
        if lemma in lemmas and members > most:
            best, most = line[:8], members
    return best


def main() -> int:
    terms: dict[str, str] = {}
    header = []
    for domain in DOMAINS:
        offset = domain_synset(domain)
        lemmas, pointers = lemmas_and_pointers(synset_line("n", offset))
        members = [(target, pos) for symbol, target, pos in pointers if symbol == "-c"]
        header.append(f"# {domain.replace('_', ' ')}: synset {offset} ({', '.join(lemmas)}), {len(members)} members")
        for target, pos in members:
            for lemma in lemmas_and_pointers(synset_line(pos, target))[0]:
                word = re.sub(r"\(.*\)$", "", lemma).replace("_", " ")
                if TERM.fullmatch(word) and sum(ch.isalpha() for ch in word) >= 4 and \
                        zipf_frequency(word, "en") < MAX_ZIPF:
                    terms.setdefault(word, domain)
    print(f"# WordNet 3.0 topic-domain terms with wordfreq Zipf < {MAX_ZIPF}, made by results/terms/make_terms.py")
    print("\n".join(header))
    for word in sorted(terms):
        print(word)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What ``usp data CONFIG`` shows: the packed rows the trainer would see, decoded, with
the trained spans marked, and the counts per data file.

The rows come from the trainer's own pipeline: the config's ``[data]`` read by
:func:`usp.train.components.prepare_data`, tokenised into (or reused from) the output
directory's cache by :func:`usp.train.components.load_dataset`, packed with the document
multiple of the config's layout and degrees, and labelled by the loader's own shift. A
token is marked trained when its label -- the one the token before it predicts --
carries loss, exactly as in the step the trainer runs. Nothing else is built (no process
group, no model weights).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from usp.models import document_cost
from usp.sp.assignment import assign_documents
from usp.train import components
from usp.train.data import IGNORE_INDEX, load_cache, micro_batch_of
from usp.train.data.corpus import cache_dir
from usp.train.data.records import FILE_COUNTS
from usp.train.preflight import grid_of

#: how trained tokens are marked in the text view (they carry loss)
OPEN, CLOSE = "\u27e6", "\u27e7"  # ⟦ ⟧
#: characters of one span shown in the text view unless ``full`` (its head and tail)
SPAN_CHARS = 240


def view_data(job, *, rows: int, world_size: int | None = None) -> dict[str, Any]:
    """The first ``rows`` global rows and the counts, as plain JSON types (``usp data
    --json``). ``world_size``: for a config whose ``[cluster]`` leaves it to the launch."""
    resolved = components.topology_config(job).resolve(world_size)
    grid = grid_of(resolved)
    document_multiple = components.check_lengths(job, grid)
    accumulation = job.gradient_accumulation(resolved.dp)
    source = components.model_source(job)
    inputs = components.prepare_data(job, source, document_multiple)
    cache_root = job.output_dir / "cache"  # the trainer's: built here once, reused there
    dataset = components.load_dataset(job, inputs, cache_root=cache_root)
    t = job.train
    per_replica = accumulation * t.micro_batch
    place = None
    if grid.placement == "documents":  # each row's assignment, as the trainer's plan makes it
        cost = document_cost(source.config)

        def place(lengths):
            bounds = [0]
            for n in lengths:
                bounds.append(bounds[-1] + n)
            return assign_documents(
                bounds, ring=grid.ring_degree, ulysses=grid.ulysses_degree, layout=grid.layout,
                multiple=grid.sequence_multiple, cost=cost,
            )  # fmt: skip

    shown = [
        _row(dataset, inputs.tokenizer, g, t.global_batch, per_replica, t.micro_batch, place)
        for g in range(rows)
    ]
    return {
        "config": job.source,
        "seq_len": t.seq_len,
        "document_multiple": document_multiple,
        "token_placement": grid.placement,
        "sp": grid.ring_degree * grid.ulysses_degree,
        "global_batch": t.global_batch,
        "dp": resolved.dp,
        "micro_batch": t.micro_batch,
        "gradient_accumulation": accumulation,
        "tokenizer": inputs.tokenizer.describe(),
        "files": _file_counts(dataset, inputs, cache_root),
        "totals": _totals(dataset.documents),
        "notes": dataset.summary(t.steps * t.global_batch),
        "rows": shown,
    }


# ----------------------------------------------------------------------------- counts
def _totals(corpus) -> dict[str, int]:
    starts = corpus.offsets[:-1]  # nothing predicts a document's first token
    trained = int(corpus.target.sum()) - int(corpus.target[starts].sum()) if len(corpus) else 0
    return {"documents": len(corpus), "tokens": corpus.num_tokens, "trained_tokens": trained}


def _file_counts(dataset, inputs, cache_root) -> list[dict[str, Any]]:
    """Per data file: records read, documents kept (after ``long_documents``), tokens and
    trained tokens (the cache's counts, made while tokenising)."""
    if not inputs.files:
        return [{"file": "synthetic", "records": None, **_totals(dataset.documents)}]
    _, report, _ = load_cache(cache_dir(cache_root, dataset.fingerprint))
    counts = report.files
    return [
        {"file": str(path), **{k: counts.get(str(path), {}).get(k, 0) for k in FILE_COUNTS}}
        for path in inputs.files
    ]


# ----------------------------------------------------------------------------- rows
def _row(
    dataset, tokenizer, index: int, global_batch: int, per_replica: int, micro: int, place=None
):
    row = dataset.sequence(index)
    # placement="documents": where each document goes (an SP rank, or "split")
    owner = None if place is None else _owners(place(row.lengths))
    labels = micro_batch_of([row]).labels[0]
    # token j is trained when the label at j - 1 (what predicts it) carries loss
    trained = [False, *(labels[:-1] != IGNORE_INDEX).tolist()]
    tokens = row.tokens.tolist()
    corpus, m = dataset.documents, dataset.document_multiple
    documents, offset = [], 0
    for doc in dataset.document_ids(index):
        length = int(corpus.offsets[doc + 1] - corpus.offsets[doc])
        padded = -(-length // m) * m
        ids, flags = tokens[offset : offset + length], trained[offset : offset + length]
        documents.append(
            {
                "corpus_index": doc,
                "tokens": length,
                "padding": padded - length,
                "trained_tokens": sum(flags),
                "spans": list(_spans(tokenizer, ids, flags)),
                **({} if owner is None else {"placed": owner[len(documents)]}),
            }
        )
        offset += padded
    within = index % global_batch
    return {
        "index": index,
        "step": index // global_batch + 1,
        "dp_replica": within // per_replica,
        "micro_batch": within % per_replica // micro,
        "tokens": len(tokens),
        "trained_tokens": sum(trained),
        "padding": len(tokens) - sum(d["tokens"] for d in documents),
        "documents": documents,
        **({} if owner is None else {"padding_placed": owner[len(documents) :]}),
    }


def _owners(assignment) -> list:
    """Each document's place (a packed row's documents are never empty): its SP rank, or
    ``"split"`` over the SP group."""
    return ["split" if rank < 0 else rank for rank in assignment.encoded()]


def _spans(tokenizer, ids: list[int], flags: list[bool]) -> Iterator[dict[str, Any]]:
    """Runs of tokens alike in being trained, decoded."""
    start = 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or flags[end] != flags[start]:
            yield {
                "trained": flags[start],
                "tokens": end - start,
                "text": tokenizer.decode(ids[start:end]),
            }
            start = end


# ----------------------------------------------------------------------------- text
def _visible(text: str) -> str:
    """Control characters (newlines, a byte tokenizer's BOS) as escapes, on one line."""
    out = []
    for ch in text:
        if ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


def _shortened(text: str, full: bool) -> str:
    if full or len(text) <= SPAN_CHARS:
        return text
    half = SPAN_CHARS // 2
    return f"{text[:half]} [... {len(text) - 2 * half} characters ...] {text[-half:]}"


def _marked(doc: dict[str, Any], full: bool) -> str:
    parts = []
    for span in doc["spans"]:
        text = _shortened(_visible(span["text"]), full)
        parts.append(f"{OPEN}{text}{CLOSE}" if span["trained"] else text)
    return "".join(parts)


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _placed(place) -> str:
    """Where ``token_placement = "documents"`` puts a document (nothing otherwise)."""
    if place is None:
        return ""
    return " [split over the SP group]" if place == "split" else f" [whole on SP rank {place}]"


def view_text(view: dict[str, Any], *, full: bool = False) -> str:
    """The text view of :func:`view_data`'s result."""
    lines = [
        f"usp data: {view['config']}",
        f"  rows:  {view['seq_len']:,} tokens each; global_batch {view['global_batch']} = dp "
        f"{view['dp']} x micro_batch {view['micro_batch']} x accumulation "
        f"{view['gradient_accumulation']}; documents padded to multiples of "
        f"{view['document_multiple']}; token_placement {view['token_placement']!r} over "
        f"{view['sp']} SP ranks",
        f"  tokenizer: {view['tokenizer']}",
        *(f"  data:  {line}" for line in view["notes"]),
        "  files:",
    ]
    for f in view["files"]:
        records = "" if f["records"] is None else f"{_count(f['records'], 'record')} -> "
        lines.append(
            f"    {f['file']}: {records}{_count(f['documents'], 'document')}, "
            f"{_count(f['tokens'], 'token')}, {f['trained_tokens']:,} trained"
        )
    t = view["totals"]
    lines.append(
        f"    total: {_count(t['documents'], 'document')}, {_count(t['tokens'], 'token')}, "
        f"{t['trained_tokens']:,} trained"
    )
    lines.append(
        f"  marks: {OPEN}...{CLOSE} trained tokens (their prediction carries loss); "
        "\\n and \\xNN: control characters"
    )
    for row in view["rows"]:
        lines += [
            "",
            f"row {row['index']} (step {row['step']}, dp replica {row['dp_replica']}, "
            f"micro-batch {row['micro_batch']}): {_count(len(row['documents']), 'document')}, "
            f"{row['trained_tokens']:,} of {row['tokens']:,} tokens trained, "
            f"{row['padding']:,} padding",
        ]
        for i, doc in enumerate(row["documents"]):
            pad = f" + {doc['padding']} padding" if doc["padding"] else ""
            lines.append(
                f"  document {i} (#{doc['corpus_index']}: {_count(doc['tokens'], 'token')}{pad}, "
                f"{doc['trained_tokens']:,} trained){_placed(doc.get('placed'))}"
            )
            lines.append(f"    {_marked(doc, full)}")
        for place in row.get("padding_placed", ()):
            lines.append(f"  padding document{_placed(place)}")
    return "\n".join(lines)

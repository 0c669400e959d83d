"""A Python producer on SQLite (the standard library's sqlite3), for
tests/tests/producers.rs.

Saves an invoice row and enqueues its email job in ONE transaction, through
the view idem_enqueue in the store's own database file: both commit or
neither does. The part between the readme markers is the README's snippet,
word for word (the test checks it).

    python3 sqlite_enqueue.py DATABASE_PATH commit|rollback INVOICE_ID RECIPIENT

Prints the job id (on rollback too: the id the rolled-back job had).
"""

import sys

# readme:start
import json
import sqlite3


def create_invoice(db: sqlite3.Connection, invoice_id: int, recipient: str) -> int:
    """Saves the invoice and enqueues its email, in the caller's transaction."""
    db.execute("INSERT INTO invoices (invoice_id, recipient) VALUES (?, ?)", (invoice_id, recipient))
    db.execute(
        "INSERT INTO idem_enqueue (plugin, payload, key) VALUES ('send_invoice_email', ?, ?)",
        (json.dumps({"invoice_id": invoice_id, "recipient": recipient}), f"invoice:{invoice_id}:email"),
    )
    # The job's id (the existing job's when the key was taken), readable
    # until this transaction ends: no one else can enqueue in between.
    (job_id,) = db.execute("SELECT job_id FROM idem_enqueue_last").fetchone()
    return job_id
# readme:end


def main() -> None:
    path, mode, invoice_id, recipient = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    # BEGIN IMMEDIATE before the first INSERT: the write lock is taken (or
    # waited for, up to the timeout) at once, never upgraded midway.
    db = sqlite3.connect(path, timeout=10, isolation_level="IMMEDIATE")
    try:
        job_id = create_invoice(db, invoice_id, recipient)
        if mode == "commit":
            db.commit()
        elif mode == "rollback":
            db.rollback()
        else:
            raise SystemExit(f"unknown mode {mode!r}")
    finally:
        db.close()
    print(job_id)


if __name__ == "__main__":
    main()

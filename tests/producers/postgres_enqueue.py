"""A Python producer on PostgreSQL (psycopg 3), for tests/tests/producers.rs.

Saves an invoice row and enqueues its email job in ONE transaction, with
idem_enqueue(): both commit or neither does. The part between the readme
markers is the README's snippet, word for word (the test checks it).

    DATABASE_URL=postgres://... python3 postgres_enqueue.py commit|rollback INVOICE_ID RECIPIENT

Prints the job id (on rollback too: the id the rolled-back job had).
"""

import os
import sys

# readme:start
import psycopg
from psycopg.types.json import Jsonb


def create_invoice(conn: psycopg.Connection, invoice_id: int, recipient: str) -> int:
    """Saves the invoice and enqueues its email, in the caller's transaction."""
    conn.execute(
        "INSERT INTO invoices (invoice_id, recipient) VALUES (%s, %s)",
        (invoice_id, recipient),
    )
    (job_id,) = conn.execute(
        "SELECT idem_enqueue(plugin => 'send_invoice_email', payload => %s, key => %s)",
        (Jsonb({"invoice_id": invoice_id, "recipient": recipient}), f"invoice:{invoice_id}:email"),
    ).fetchone()
    return job_id
# readme:end


def main() -> None:
    mode, invoice_id, recipient = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    # psycopg opens a transaction with the first statement.
    with psycopg.connect(os.environ["DATABASE_URL"]) as conn:
        job_id = create_invoice(conn, invoice_id, recipient)
        if mode == "commit":
            conn.commit()
        elif mode == "rollback":
            conn.rollback()
        else:
            raise SystemExit(f"unknown mode {mode!r}")
    print(job_id)


if __name__ == "__main__":
    main()

// A Node producer on PostgreSQL (node-postgres), for tests/tests/producers.rs.
//
// Saves an invoice row and enqueues its email job in ONE transaction, with
// idem_enqueue(): both commit or neither does. The part between the readme
// markers is the README's snippet, word for word (the test checks it).
//
//     DATABASE_URL=postgres://... node enqueue.mjs commit|rollback INVOICE_ID RECIPIENT
//
// Prints the job id (on rollback too: the id the rolled-back job had).

// readme:start
import pg from "pg";

// Saves the invoice and enqueues its email, in the caller's transaction.
async function createInvoice(client, invoiceId, recipient) {
  await client.query("INSERT INTO invoices (invoice_id, recipient) VALUES ($1, $2)", [invoiceId, recipient]);
  const { rows } = await client.query(
    "SELECT idem_enqueue(plugin => 'send_invoice_email', payload => $1::jsonb, key => $2) AS job_id",
    [JSON.stringify({ invoice_id: invoiceId, recipient }), `invoice:${invoiceId}:email`],
  );
  return rows[0].job_id; // a string: node-postgres reads bigint as text
}
// readme:end

const [mode, invoiceId, recipient] = process.argv.slice(2);
if (mode !== "commit" && mode !== "rollback") {
  console.error(`unknown mode ${mode}`);
  process.exit(2);
}
const client = new pg.Client({ connectionString: process.env.DATABASE_URL });
await client.connect();
try {
  await client.query("BEGIN");
  const jobId = await createInvoice(client, Number(invoiceId), recipient);
  await client.query(mode === "commit" ? "COMMIT" : "ROLLBACK");
  console.log(jobId);
} finally {
  await client.end();
}

//! Database effects (`sql` providers) end to end, on both backends: every
//! order delivered twice writes one invoice row; the store's own database
//! commits the row with its ledger mark; another database keeps a guard row;
//! hostile plugins cannot make the host run SQL of their choosing; a crash
//! before or after the statement leaves one row after the takeover.

use idem::providers::{ProviderConfig, Providers};
use idem::store::{EffectStatus, JobFilter, JobState, NewJob};
use idem_tests::{Backend, Harness, both_backends};
use std::collections::BTreeMap;
use std::time::Duration;

const CREATE_INVOICE: &str = "INSERT INTO invoices (order_id, amount_cents, customer) \
    VALUES ($1, $2, $3) ON CONFLICT (order_id) DO NOTHING RETURNING id";

/// Without `ON CONFLICT`: a second run fails on the business constraint,
/// so only the ledger's transaction or the guard can keep it from running.
const CREATE_INVOICE_ONCE: &str = "INSERT INTO invoices (order_id, amount_cents, customer) \
    VALUES ($1, $2, $3) RETURNING id";

fn order(id: &str, amount_cents: i64) -> NewJob {
    NewJob::new(
        "create_invoice",
        format!(
            r#"{{"order_id": "{id}", "amount_cents": {amount_cents}, "customer": "{id}@example.com"}}"#
        )
        .into_bytes(),
    )
}

/// A database other than the store's: a fresh SQLite file, or a fresh
/// schema of the local PostgreSQL.
struct OtherDb {
    url: String,
    _dir: Option<tempfile::TempDir>,
}

async fn other_db(backend: Backend) -> OtherDb {
    match backend {
        Backend::Sqlite => {
            let dir = tempfile::tempdir().unwrap();
            let url = format!("sqlite://{}", dir.path().join("billing.db").display());
            OtherDb {
                url,
                _dir: Some(dir),
            }
        }
        Backend::Postgres => {
            let schema = format!("billing_{}", hex::encode(rand::random::<[u8; 6]>()));
            exec(
                &idem_tests::database_url(),
                &format!("CREATE SCHEMA {schema}"),
            )
            .await;
            OtherDb {
                url: format!(
                    "{}?options=-c%20search_path%3D{schema}",
                    idem_tests::database_url()
                ),
                _dir: None,
            }
        }
    }
}

async fn exec(url: &str, sql: &str) {
    if url.starts_with("postgres") {
        let pool = sqlx::PgPool::connect(url).await.unwrap();
        sqlx::query(sql).execute(&pool).await.unwrap();
        pool.close().await;
    } else {
        let options: sqlx::sqlite::SqliteConnectOptions = url.parse().unwrap();
        let pool = sqlx::SqlitePool::connect_with(options.create_if_missing(true))
            .await
            .unwrap();
        sqlx::query(sql).execute(&pool).await.unwrap();
        pool.close().await;
    }
}

async fn count(url: &str, sql: &str) -> i64 {
    if url.starts_with("postgres") {
        let pool = sqlx::PgPool::connect(url).await.unwrap();
        let n: i64 = sqlx::query_scalar(sql).fetch_one(&pool).await.unwrap();
        pool.close().await;
        n
    } else {
        let pool = sqlx::SqlitePool::connect(url).await.unwrap();
        let n: i64 = sqlx::query_scalar(sql).fetch_one(&pool).await.unwrap();
        pool.close().await;
        n
    }
}

async fn create_invoices_table(url: &str) {
    let id = if url.starts_with("postgres") {
        "id BIGSERIAL PRIMARY KEY"
    } else {
        "id INTEGER PRIMARY KEY"
    };
    exec(
        url,
        &format!(
            "CREATE TABLE invoices ({id}, order_id TEXT NOT NULL UNIQUE, \
             amount_cents BIGINT NOT NULL, customer TEXT NOT NULL)"
        ),
    )
    .await;
}

/// The `[providers.billing_db]` table: the store's own database when `url`
/// is `None`.
fn billing_toml_with(url: Option<&str>, statement: &str) -> String {
    let url = url.map(|u| format!("url = \"{u}\"\n")).unwrap_or_default();
    format!(
        "kind = \"sql\"\n{url}timeout = \"5s\"\nbreaker_failures = 1000\n\
         statements.create_invoice = \"{statement}\"\n"
    )
}

fn providers(h: &Harness, billing_url: Option<&str>) -> Providers {
    providers_with(h, billing_url, CREATE_INVOICE)
}

fn providers_with(h: &Harness, billing_url: Option<&str>, statement: &str) -> Providers {
    let mut configs: BTreeMap<String, ProviderConfig> = BTreeMap::new();
    configs.insert(
        "email".into(),
        toml::from_str(&format!(
            "kind = \"email\"\nbase_url = \"{}\"\ntimeout = \"1s\"\nbreaker_failures = 1000",
            h.provider.base_url
        ))
        .unwrap(),
    );
    configs.insert(
        "billing_db".into(),
        toml::from_str(&billing_toml_with(billing_url, statement)).unwrap(),
    );
    Providers::for_store(&configs, &h.url).expect("providers")
}

async fn dead_codes(h: &Harness) -> Vec<String> {
    let mut codes: Vec<String> = h
        .store
        .job_list(JobFilter {
            states: vec![JobState::Dead],
            limit: 100,
            ..JobFilter::default()
        })
        .await
        .unwrap()
        .into_iter()
        .filter_map(|job| job.last_error_code)
        .collect();
    codes.sort();
    codes
}

async fn every_order_twice_one_row_in_the_stores_own_database(backend: Backend) {
    let h = Harness::new(backend).await;
    create_invoices_table(&h.url).await;
    for i in 1..=5 {
        for _ in 0..2 {
            h.store
                .job_insert(order(&format!("o-{i}"), 100 * i))
                .await
                .unwrap();
        }
    }
    h.store.job_insert(order("o-neg", -1)).await.unwrap();
    // Without ON CONFLICT: a second run of a statement would dead-letter its job.
    let stats = h
        .drain_with(providers_with(&h, None, CREATE_INVOICE_ONCE))
        .await;
    assert_eq!(stats.succeeded, 10, "{stats:?}");
    assert_eq!(count(&h.url, "SELECT count(*) FROM invoices").await, 5);
    assert_eq!(
        count(&h.url, "SELECT count(DISTINCT order_id) FROM invoices").await,
        5
    );
    for i in 1..=5 {
        let key = format!("create_invoice/order:o-{i}:invoice");
        let row = h.store.effect_get(&key).await.unwrap().unwrap();
        assert_eq!(row.status, EffectStatus::Succeeded);
        let id: i64 = row.result_ref.as_deref().unwrap().parse().unwrap();
        let order_id = format!("o-{i}");
        assert_eq!(
            count(
                &h.url,
                &format!(
                    "SELECT count(*) FROM invoices WHERE id = {id} AND order_id = '{order_id}'"
                )
            )
            .await,
            1,
            "the ledger's result_ref is the invoice row's id"
        );
        assert_eq!(
            h.provider
                .applied(&format!("create_invoice/order:o-{i}:invoice-email")),
            1
        );
    }
    assert_eq!(dead_codes(&h).await, ["invalid_amount"]);
    assert_eq!(
        count(
            &h.url,
            "SELECT count(*) FROM invoices WHERE order_id = 'o-neg'"
        )
        .await,
        0
    );
}

async fn another_database_keeps_a_guard_row_per_key(backend: Backend) {
    let h = Harness::new(backend).await;
    let billing = other_db(backend).await;
    create_invoices_table(&billing.url).await;
    for i in 1..=3 {
        for _ in 0..2 {
            h.store
                .job_insert(order(&format!("o-{i}"), 100))
                .await
                .unwrap();
        }
    }
    let stats = h
        .drain_with(providers_with(&h, Some(&billing.url), CREATE_INVOICE_ONCE))
        .await;
    assert_eq!(stats.succeeded, 6, "{stats:?}");
    assert_eq!(
        count(&billing.url, "SELECT count(*) FROM invoices").await,
        3
    );
    assert_eq!(
        count(&billing.url, "SELECT count(*) FROM idem_effects").await,
        3,
        "one guard row per key"
    );
    let key = "create_invoice/order:o-1:invoice";
    let row = h.store.effect_get(key).await.unwrap().unwrap();
    assert_eq!(row.status, EffectStatus::Succeeded);
    assert_eq!(
        count(
            &billing.url,
            &format!(
                "SELECT count(*) FROM idem_effects WHERE key = '{key}' AND result_ref = '{}'",
                row.result_ref.unwrap()
            )
        )
        .await,
        1,
        "the guard row and the ledger agree on the result"
    );
}

async fn concurrent_redeliveries_write_one_row(backend: Backend) {
    concurrent_redeliveries(backend, false).await;
}

async fn concurrent_redeliveries_through_the_guard_write_one_row(backend: Backend) {
    concurrent_redeliveries(backend, true).await;
}

async fn concurrent_redeliveries(backend: Backend, other: bool) {
    let h = Harness::new(backend).await;
    let billing = other_db(backend).await;
    let url = if other {
        billing.url.clone()
    } else {
        h.url.clone()
    };
    create_invoices_table(&url).await;
    for _ in 0..6 {
        h.store.job_insert(order("o-7", 700)).await.unwrap();
    }
    let billing_url = other.then_some(url.as_str());
    let worker = |id: &str| {
        idem::queue::Worker::new(
            h.store.clone(),
            h.registry.clone(),
            providers_with(&h, billing_url, CREATE_INVOICE_ONCE),
            h.settings(id),
        )
        .run(tokio_util::sync::CancellationToken::new())
    };
    let (a, b) = tokio::time::timeout(Duration::from_secs(60), async {
        tokio::join!(worker("worker-a"), worker("worker-b"))
    })
    .await
    .expect("both workers drain within 60 s");
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a.succeeded + b.succeeded, 6, "{a:?} {b:?}");
    assert_eq!(count(&url, "SELECT count(*) FROM invoices").await, 1);
    assert_eq!(
        h.provider.applied("create_invoice/order:o-7:invoice-email"),
        1
    );
}

async fn hostile_plugins_cannot_run_sql_of_their_own(backend: Backend) {
    let h = Harness::new(backend).await;
    create_invoices_table(&h.url).await;
    for mode in [
        "sql_text",
        "raw_sql",
        "undeclared",
        "wrong_count",
        "injection",
    ] {
        h.store
            .job_insert(NewJob::new(
                "hostile_sql",
                format!(r#"{{"mode": "{mode}"}}"#).into_bytes(),
            ))
            .await
            .unwrap();
    }
    let stats = h.drain_with(providers(&h, None)).await;
    assert_eq!(
        stats.succeeded, 1,
        "only the bound injection value runs: {stats:?}"
    );
    assert_eq!(
        dead_codes(&h).await,
        [
            "sql_params_invalid",
            "sql_statement_unknown",
            "sql_statement_unknown",
            "sql_statement_unknown"
        ]
    );
    for mode in ["sql_text", "raw_sql", "undeclared", "wrong_count"] {
        assert!(
            h.store
                .effect_get(&format!("hostile_sql/hostile:{mode}"))
                .await
                .unwrap()
                .is_none(),
            "{mode}: refused before its key was claimed"
        );
    }
    assert_eq!(
        count(&h.url, "SELECT count(*) FROM invoices").await,
        1,
        "the table survived; the hostile text is one row's order id"
    );
    assert_eq!(
        count(
            &h.url,
            "SELECT count(*) FROM invoices WHERE order_id = 'o-x''); DROP TABLE invoices; --'"
        )
        .await,
        1
    );
}

async fn a_business_constraint_the_statement_does_not_handle_is_permanent(backend: Backend) {
    let h = Harness::new(backend).await;
    create_invoices_table(&h.url).await;
    exec(
        &h.url,
        "INSERT INTO invoices (order_id, amount_cents, customer) VALUES ('o-9', 1, 'x@example.com')",
    )
    .await;
    let mut configs: BTreeMap<String, ProviderConfig> = BTreeMap::new();
    configs.insert(
        "email".into(),
        toml::from_str(&format!(
            "kind = \"email\"\nbase_url = \"{}\"",
            h.provider.base_url
        ))
        .unwrap(),
    );
    configs.insert(
        "billing_db".into(),
        toml::from_str(
            "kind = \"sql\"\nstatements.create_invoice = \"INSERT INTO invoices (order_id, amount_cents, customer) VALUES ($1, $2, $3)\"",
        )
        .unwrap(),
    );
    h.store.job_insert(order("o-9", 900)).await.unwrap();
    h.drain_with(Providers::for_store(&configs, &h.url).unwrap())
        .await;
    assert_eq!(dead_codes(&h).await, ["sql_constraint_violation"]);
    let row = h
        .store
        .effect_get("create_invoice/order:o-9:invoice")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(row.status, EffectStatus::Failed);
    assert_eq!(
        h.provider
            .requests("create_invoice/order:o-9:invoice-email"),
        0,
        "the plan stopped at the failed statement"
    );
}

/// Crash windows, with an `idem run` process that dies at a failpoint and a
/// takeover once its lease has run out (by the store's clock).
mod crashes {
    use super::*;

    async fn dies(h: &Harness, billing_url: Option<&str>, failpoint: &str) {
        let config = h.config_file(Duration::from_secs(5));
        let mut text = std::fs::read_to_string(config.path()).unwrap();
        text.push_str("\n[providers.billing_db]\n");
        text.push_str(&billing_toml_with(billing_url, CREATE_INVOICE_ONCE));
        std::fs::write(config.path(), text).unwrap();
        let mut child = idem_tests::spawn_drain(
            env!("CARGO_BIN_EXE_idem-test"),
            config.path(),
            &format!("{failpoint}=abort"),
        );
        let status = tokio::time::timeout(Duration::from_secs(60), child.wait())
            .await
            .expect("the process reaches its failpoint within 60 s")
            .unwrap();
        assert!(!status.success(), "it died at {failpoint}");
    }

    async fn take_over(h: &Harness, billing_url: Option<&str>) {
        h.store
            .clock_advance(Duration::from_secs(600))
            .await
            .unwrap();
        h.store.job_rescue_expired(100).await.unwrap();
        let stats = h
            .drain_with(providers_with(h, billing_url, CREATE_INVOICE_ONCE))
            .await;
        assert_eq!(stats.succeeded, 1, "{stats:?}");
    }

    const KEY: &str = "create_invoice/order:o-1:invoice";

    async fn same_database_crash_inside_the_transaction(backend: Backend) {
        let h = Harness::new(backend).await;
        create_invoices_table(&h.url).await;
        h.store.job_insert(order("o-1", 100)).await.unwrap();
        dies(&h, None, "after_statement").await;
        assert_eq!(
            count(&h.url, "SELECT count(*) FROM invoices").await,
            0,
            "neither the row"
        );
        let row = h.store.effect_get(KEY).await.unwrap().unwrap();
        assert_eq!(row.status, EffectStatus::Processing, "nor the ledger mark");
        take_over(&h, None).await;
        assert_eq!(count(&h.url, "SELECT count(*) FROM invoices").await, 1);
        let row = h.store.effect_get(KEY).await.unwrap().unwrap();
        assert_eq!(row.status, EffectStatus::Succeeded);
    }

    async fn same_database_crash_after_the_commit(backend: Backend) {
        let h = Harness::new(backend).await;
        create_invoices_table(&h.url).await;
        h.store.job_insert(order("o-1", 100)).await.unwrap();
        dies(&h, None, "after_key_marked").await;
        assert_eq!(
            count(&h.url, "SELECT count(*) FROM invoices").await,
            1,
            "both"
        );
        let row = h.store.effect_get(KEY).await.unwrap().unwrap();
        assert_eq!(row.status, EffectStatus::Succeeded);
        take_over(&h, None).await;
        assert_eq!(count(&h.url, "SELECT count(*) FROM invoices").await, 1);
    }

    async fn other_database_crash_between_the_two_commits(backend: Backend) {
        let h = Harness::new(backend).await;
        let billing = other_db(backend).await;
        create_invoices_table(&billing.url).await;
        h.store.job_insert(order("o-1", 100)).await.unwrap();
        dies(&h, Some(&billing.url), "after_provider_call").await;
        assert_eq!(
            count(&billing.url, "SELECT count(*) FROM invoices").await,
            1
        );
        assert_eq!(
            count(&billing.url, "SELECT count(*) FROM idem_effects").await,
            1
        );
        let row = h.store.effect_get(KEY).await.unwrap().unwrap();
        assert_eq!(
            row.status,
            EffectStatus::Processing,
            "the ledger never heard"
        );
        take_over(&h, Some(&billing.url)).await;
        assert_eq!(
            count(&billing.url, "SELECT count(*) FROM invoices").await,
            1,
            "the guard answered; the statement did not run again"
        );
        let row = h.store.effect_get(KEY).await.unwrap().unwrap();
        assert_eq!(row.status, EffectStatus::Succeeded);
        assert!(row.result_ref.is_some());
    }

    async fn other_database_crash_inside_its_transaction(backend: Backend) {
        let h = Harness::new(backend).await;
        let billing = other_db(backend).await;
        create_invoices_table(&billing.url).await;
        h.store.job_insert(order("o-1", 100)).await.unwrap();
        dies(&h, Some(&billing.url), "after_statement").await;
        assert_eq!(
            count(&billing.url, "SELECT count(*) FROM invoices").await,
            0
        );
        assert_eq!(
            count(&billing.url, "SELECT count(*) FROM idem_effects").await,
            0
        );
        take_over(&h, Some(&billing.url)).await;
        assert_eq!(
            count(&billing.url, "SELECT count(*) FROM invoices").await,
            1
        );
        assert_eq!(
            count(&billing.url, "SELECT count(*) FROM idem_effects").await,
            1
        );
    }

    /// A plan whose only (so last) effect is a statement on the store's own
    /// database: the job's success commits with the row and its ledger
    /// mark, so a crash right after that commit leaves the job done, with
    /// nothing to redeliver.
    async fn a_last_statement_commits_the_jobs_success_with_it(backend: Backend) {
        let h = Harness::new(backend).await;
        exec(
            &h.url,
            "CREATE TABLE idem_bench_rows (i BIGINT PRIMARY KEY)",
        )
        .await;
        let job = h
            .store
            .job_insert(NewJob::new("bench_sql", br#"{"i": 7}"#.to_vec()))
            .await
            .unwrap();
        let config = h.config_file(Duration::from_secs(5));
        let mut text = std::fs::read_to_string(config.path()).unwrap();
        text.push_str(
            "\n[providers.bench_db]\nkind = \"sql\"\ntimeout = \"5s\"\n\
             statements.insert_row = \"INSERT INTO idem_bench_rows (i) VALUES ($1) RETURNING i\"\n",
        );
        std::fs::write(config.path(), text).unwrap();
        let mut child = idem_tests::spawn_drain(
            env!("CARGO_BIN_EXE_idem-test"),
            config.path(),
            "after_key_marked=abort",
        );
        let status = tokio::time::timeout(Duration::from_secs(60), child.wait())
            .await
            .expect("the process reaches its failpoint within 60 s")
            .unwrap();
        assert!(!status.success(), "it died after the statement's commit");
        let row = h
            .store
            .effect_get("bench_sql/bench:7:row")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(row.status, EffectStatus::Succeeded);
        assert_eq!(row.result_ref.as_deref(), Some("7"));
        let job = h.store.job_get(job.id).await.unwrap().unwrap();
        assert_eq!(
            job.state,
            JobState::Succeeded,
            "the job's success committed with the statement"
        );
        assert_eq!(
            count(&h.url, "SELECT count(*) FROM idem_bench_rows").await,
            1
        );
    }

    both_backends!(
        a_last_statement_commits_the_jobs_success_with_it,
        same_database_crash_inside_the_transaction,
        same_database_crash_after_the_commit,
        other_database_crash_between_the_two_commits,
        other_database_crash_inside_its_transaction,
    );
}

both_backends!(
    every_order_twice_one_row_in_the_stores_own_database,
    another_database_keeps_a_guard_row_per_key,
    concurrent_redeliveries_write_one_row,
    concurrent_redeliveries_through_the_guard_write_one_row,
    hostile_plugins_cannot_run_sql_of_their_own,
    a_business_constraint_the_statement_does_not_handle_is_permanent,
);

/// The application's role may read and write rows but not create tables:
/// the guard table is made once by `idem migrate --provider` (here: the
/// provider's `migrate` as the owner), and the runtime then only uses it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_role_without_create_rights_uses_the_migrated_guard_table() {
    let h = Harness::new(Backend::Postgres).await;
    let billing = other_db(Backend::Postgres).await;
    create_invoices_table(&billing.url).await;
    let schema = billing
        .url
        .rsplit("search_path%3D")
        .next()
        .unwrap()
        .to_string();
    let owner: ProviderConfig =
        toml::from_str(&billing_toml_with(Some(&billing.url), CREATE_INVOICE_ONCE)).unwrap();
    let migrated = idem::providers::sql::SqlProvider::from_config("billing_db", &owner, &h.url)
        .unwrap()
        .migrate()
        .await
        .unwrap();
    assert!(migrated, "the guard table is made in the other database");
    let role = format!("idem_app_{}", hex::encode(rand::random::<[u8; 4]>()));
    for sql in [
        format!("CREATE ROLE {role} LOGIN"),
        format!("GRANT USAGE ON SCHEMA {schema} TO {role}"),
        format!("GRANT SELECT, INSERT, UPDATE ON ALL TABLES IN SCHEMA {schema} TO {role}"),
        format!("GRANT USAGE ON ALL SEQUENCES IN SCHEMA {schema} TO {role}"),
    ] {
        exec(&idem_tests::database_url(), &sql).await;
    }
    let app_url = billing.url.replace("postgres@", &format!("{role}@"));
    assert_ne!(app_url, billing.url);
    h.store.job_insert(order("o-1", 100)).await.unwrap();
    h.store.job_insert(order("o-1", 100)).await.unwrap();
    let stats = h
        .drain_with(providers_with(&h, Some(&app_url), CREATE_INVOICE_ONCE))
        .await;
    for sql in [
        format!("REVOKE ALL ON ALL TABLES IN SCHEMA {schema} FROM {role}"),
        format!("REVOKE ALL ON ALL SEQUENCES IN SCHEMA {schema} FROM {role}"),
        format!("REVOKE ALL ON SCHEMA {schema} FROM {role}"),
        format!("DROP ROLE {role}"),
    ] {
        exec(&idem_tests::database_url(), &sql).await;
    }
    assert_eq!(stats.succeeded, 2, "{stats:?}");
    assert!(dead_codes(&h).await.is_empty());
    assert_eq!(
        count(&billing.url, "SELECT count(*) FROM invoices").await,
        1
    );
    assert_eq!(
        count(&billing.url, "SELECT count(*) FROM idem_effects").await,
        1
    );
}

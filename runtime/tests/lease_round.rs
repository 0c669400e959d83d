//! The lease keeper's heartbeat round over the group commit (issue 23
//! review): each extension is its own write, so one the database refuses
//! (here a trigger on one job) keeps no other held job's lease from being
//! extended. Failed on 4880c38, where the round was one `write_batch` and
//! so one unit that commits whole or not at all.

use idem::queue::lease::LeaseKeeper;
use idem::store::group_commit::{GroupCommit, GroupCommitSettings};
use idem::store::postgres::connect_with_schema;
use idem::store::{ClaimParams, Clock, NewJob, Store};
use sqlx::Connection;
use std::sync::Arc;
use std::time::Duration;

fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_refused_heartbeat_keeps_every_other_lease_from_being_extended() {
    let schema = format!("idem_lease_{}", hex::encode(rand::random::<[u8; 6]>()));
    let store = Arc::new(
        connect_with_schema(&database_url(), &schema, Clock::Adjustable)
            .await
            .unwrap(),
    );
    let outcome = tokio::spawn({
        let store = store.clone();
        async move {
            for plugin in ["fine", "poisoned"] {
                store
                    .job_insert(NewJob::new(plugin, b"{}".to_vec()))
                    .await
                    .unwrap();
            }
            let jobs = store
                .job_claim(ClaimParams {
                    queue: "default".into(),
                    worker: "w".into(),
                    limit: 2,
                    lease: Duration::from_secs(30),
                    queue_concurrency: None,
                    max_attempts: Default::default(),
                })
                .await
                .unwrap();
            assert_eq!(jobs.len(), 2);
            let pool = store.postgres_pool().unwrap();
            sqlx::query(
                "CREATE FUNCTION refuse_hb() RETURNS trigger LANGUAGE plpgsql AS \
                 $$ BEGIN RAISE EXCEPTION 'boom'; END $$",
            )
            .execute(pool)
            .await
            .unwrap();
            sqlx::query(
                "CREATE TRIGGER refuse_hb BEFORE UPDATE OF heartbeat_at ON jobs FOR EACH ROW \
                 WHEN (NEW.plugin = 'poisoned') EXECUTE FUNCTION refuse_hb()",
            )
            .execute(pool)
            .await
            .unwrap();
            let group = GroupCommit::new(store.clone(), GroupCommitSettings::default());
            let keeper = LeaseKeeper::new(Duration::ZERO);
            for job in &jobs {
                keeper.hold(
                    job,
                    // A zero lease is always due: no wait for a third of it.
                    Duration::ZERO,
                    tokio_util::sync::CancellationToken::new(),
                );
            }
            let fine = jobs.iter().find(|j| j.plugin == "fine").unwrap();
            let before = store.job_get(fine.id).await.unwrap().unwrap();
            let round = keeper.round(&*group).await;
            let after = store.job_get(fine.id).await.unwrap().unwrap();
            eprintln!(
                "round: {round:?}\nfine job heartbeat_at before {:?} after {:?}",
                before.heartbeat_at_ms, after.heartbeat_at_ms
            );
            assert_ne!(
                before.heartbeat_at_ms, after.heartbeat_at_ms,
                "the healthy job's lease must be extended although another job's heartbeat is refused"
            );
        }
    })
    .await;
    if let Ok(mut conn) = sqlx::PgConnection::connect(&database_url()).await {
        let _ = sqlx::query(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))
            .execute(&mut conn)
            .await;
    }
    if let Err(e) = outcome {
        std::panic::resume_unwind(e.into_panic());
    }
}

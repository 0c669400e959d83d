//! The schema of each backend, embedded in the binary as SQL text.
//!
//! The files in `migrations/` are the source; this module lists them with
//! `include_str!` instead of using `sqlx::migrate!`, whose proc macro would
//! build sqlx and both database drivers (SQLite's C library included) a
//! second time for the host. A unit test checks the list against the
//! directories, so a new file cannot be forgotten.

use futures::future::BoxFuture;
use sqlx::error::BoxDynError;
use sqlx::migrate::{Migration, MigrationSource, MigrationType, Migrator};
use std::borrow::Cow;

/// One backend's migrations: (version, file name, SQL).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Embedded(&'static [(i64, &'static str, &'static str)]);

macro_rules! embed {
    ($backend:literal: $($version:literal => $file:literal),+ $(,)?) => {
        Embedded(&[$((
            $version,
            $file,
            include_str!(concat!("../../../migrations/", $backend, "/", $file)),
        )),+])
    };
}

/// The SQLite schema.
pub(crate) const SQLITE: Embedded = embed!("sqlite":
    1 => "0001_init.sql",
    2 => "0002_effect_retention.sql",
    3 => "0003_clock.sql",
    4 => "0004_unknown_outcomes.sql",
    5 => "0005_fewer_index_writes.sql",
    6 => "0006_started_attempts.sql",
    7 => "0007_sessions.sql",
    8 => "0008_redact_error_urls.sql",
    9 => "0009_effect_tries.sql",
    10 => "0010_schedules.sql",
    11 => "0011_groups.sql",
    12 => "0012_enqueue_view.sql",
    13 => "0013_group_heads.sql",
);

/// The PostgreSQL schema.
pub(crate) const POSTGRES: Embedded = embed!("postgres":
    1 => "0001_init.sql",
    2 => "0002_effect_retention.sql",
    3 => "0003_clock.sql",
    4 => "0004_unknown_outcomes.sql",
    5 => "0005_notify_per_statement.sql",
    6 => "0006_fewer_index_writes.sql",
    7 => "0007_started_attempts.sql",
    8 => "0008_sessions.sql",
    9 => "0009_redact_error_urls.sql",
    10 => "0010_effect_tries.sql",
    11 => "0011_schedules.sql",
    12 => "0012_groups.sql",
    13 => "0013_enqueue_function.sql",
    14 => "0014_group_heads.sql",
);

impl Embedded {
    /// The migrator of these migrations (checksums as `sqlx migrate` computes
    /// them, so databases migrated by earlier builds validate).
    pub(crate) async fn migrator(self) -> Result<Migrator, sqlx::migrate::MigrateError> {
        Migrator::new(self).await
    }
}

impl MigrationSource<'static> for Embedded {
    fn resolve(self) -> BoxFuture<'static, Result<Vec<Migration>, BoxDynError>> {
        Box::pin(async move {
            Ok(self
                .0
                .iter()
                .map(|&(version, file, sql)| {
                    let description = file
                        .split_once('_')
                        .map_or(file, |(_, rest)| rest)
                        .trim_end_matches(".sql")
                        .replace('_', " ");
                    Migration::new(
                        version,
                        Cow::Owned(description),
                        MigrationType::Simple,
                        Cow::Borrowed(sql),
                        sql.starts_with("-- no-transaction"),
                    )
                })
                .collect())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(backend: &str) -> Vec<(i64, String)> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../migrations")
            .join(backend);
        let mut files: Vec<(i64, String)> = std::fs::read_dir(&dir)
            .expect("the migrations directory")
            .map(|entry| entry.expect("a directory entry").file_name())
            .map(|name| name.to_string_lossy().into_owned())
            .filter(|name| name.ends_with(".sql"))
            .map(|name| {
                let version = name
                    .split_once('_')
                    .and_then(|(v, _)| v.parse().ok())
                    .expect("a versioned file name");
                (version, name)
            })
            .collect();
        files.sort();
        files
    }

    #[test]
    fn every_migration_file_is_embedded() {
        for (backend, embedded) in [("sqlite", SQLITE), ("postgres", POSTGRES)] {
            let listed: Vec<(i64, String)> = embedded
                .0
                .iter()
                .map(|&(v, f, _)| (v, f.to_string()))
                .collect();
            assert_eq!(
                listed,
                files(backend),
                "{backend}: migrations/ and the list differ"
            );
        }
    }

    /// The rebuild of `jobs` and `effects` (SQLite 0005) keeps every row and
    /// the id high-water mark: a job inserted after it never reuses the id
    /// of a pruned one.
    #[tokio::test]
    async fn the_sqlite_rebuild_keeps_rows_and_the_id_sequence() {
        use sqlx::Connection;
        let mut conn = sqlx::SqliteConnection::connect("sqlite::memory:")
            .await
            .expect("an in-memory database");
        Migrator::new(Embedded(&SQLITE.0[..4]))
            .await
            .expect("the migrator up to 0004")
            .run(&mut conn)
            .await
            .expect("migrations up to 0004");
        let insert = "INSERT INTO jobs (queue, plugin, payload, idempotency_key, run_at, state, \
                      max_attempts, correlation_id, created_at, updated_at, plan) \
                      VALUES ('default', 'noop', x'7b7d', $1, 1, $2, 3, 'c', 1, 1, $3)";
        for (key, state, plan) in [
            (Some("a"), "succeeded", Some("[]")),
            (None, "available", None),
            (Some("pruned"), "succeeded", None),
        ] {
            sqlx::query(insert)
                .bind(key)
                .bind(state)
                .bind(plan)
                .execute(&mut conn)
                .await
                .expect("a job");
        }
        sqlx::query("DELETE FROM jobs WHERE idempotency_key = 'pruned'")
            .execute(&mut conn)
            .await
            .expect("prune");
        sqlx::query(
            "INSERT INTO effects (key, job_id, plugin, provider, fingerprint, status, attempt, \
             created_at, updated_at, reached) VALUES ('noop/k', 1, 'noop', 'jobs', 'f', \
             'succeeded', 1, 1, 1, 1)",
        )
        .execute(&mut conn)
        .await
        .expect("a ledger row");

        SQLITE
            .migrator()
            .await
            .expect("the migrator")
            .run(&mut conn)
            .await
            .expect("every migration");

        let jobs: Vec<(i64, Option<String>, String, Option<String>)> =
            sqlx::query_as("SELECT id, idempotency_key, state, plan FROM jobs ORDER BY id")
                .fetch_all(&mut conn)
                .await
                .expect("jobs");
        assert_eq!(
            jobs,
            vec![
                (1, Some("a".into()), "succeeded".into(), Some("[]".into())),
                (2, None, "available".into(), None),
            ]
        );
        let next: i64 = sqlx::query_scalar(
            "INSERT INTO jobs (queue, plugin, payload, run_at, state, max_attempts, \
             correlation_id, created_at, updated_at) \
             VALUES ('default', 'noop', x'7b7d', 1, 'available', 1, 'c', 1, 1) RETURNING id",
        )
        .fetch_one(&mut conn)
        .await
        .expect("a job after the rebuild");
        assert_eq!(next, 4, "id 3 was used by a pruned job");
        let duplicate = sqlx::query(insert)
            .bind(Some("a"))
            .bind("available")
            .bind(None::<String>)
            .execute(&mut conn)
            .await;
        assert!(duplicate.is_err(), "a key is still unique per plugin");
        let ledger: Vec<(String, String, i64)> =
            sqlx::query_as("SELECT key, status, reached FROM effects")
                .fetch_all(&mut conn)
                .await
                .expect("ledger rows");
        assert_eq!(ledger, vec![("noop/k".into(), "succeeded".into(), 1)]);
        let bad_state = sqlx::query("UPDATE jobs SET state = 'lost' WHERE id = 1")
            .execute(&mut conn)
            .await;
        assert!(bad_state.is_err(), "the state check still holds");
        // 0012: attempts may be left to the claim, never be zero.
        let unresolved = sqlx::query(
            "INSERT INTO jobs (queue, plugin, payload, run_at, state, max_attempts, \
             correlation_id, created_at, updated_at) \
             VALUES ('default', 'noop', x'7b7d', 1, 'available', NULL, 'c', 1, 1)",
        )
        .execute(&mut conn)
        .await;
        assert!(unresolved.is_ok(), "{unresolved:?}");
        let zero = sqlx::query("UPDATE jobs SET max_attempts = 0 WHERE id = 1")
            .execute(&mut conn)
            .await;
        assert!(zero.is_err(), "the attempts check still holds");
    }

    /// 0013 (SQLite) makes the jobs already waiting behind their group's
    /// head `blocked`, keeps the rest, and the view `idem_enqueue` it makes
    /// again blocks a job behind an open one of its group.
    #[tokio::test]
    async fn the_group_heads_migration_blocks_the_jobs_behind_each_head() {
        use sqlx::Connection;
        let mut conn = sqlx::SqliteConnection::connect("sqlite::memory:")
            .await
            .expect("an in-memory database");
        Migrator::new(Embedded(&SQLITE.0[..12]))
            .await
            .expect("the migrator up to 0012")
            .run(&mut conn)
            .await
            .expect("migrations up to 0012");
        for (group, state) in [
            ("g", "running"),
            ("g", "available"),
            ("g", "retrying"),
            ("h", "retrying"),
            ("h", "available"),
            ("i", "succeeded"),
            ("i", "available"),
        ] {
            sqlx::query(
                "INSERT INTO jobs (queue, plugin, payload, run_at, state, max_attempts, \
                 correlation_id, created_at, updated_at, group_key) \
                 VALUES ('default', 'noop', x'7b7d', 1, $1, 3, 'c', 1, 1, $2)",
            )
            .bind(state)
            .bind(group)
            .execute(&mut conn)
            .await
            .expect("a job");
        }
        SQLITE
            .migrator()
            .await
            .expect("the migrator")
            .run(&mut conn)
            .await
            .expect("every migration");
        let states: Vec<String> = sqlx::query_scalar("SELECT state FROM jobs ORDER BY id")
            .fetch_all(&mut conn)
            .await
            .expect("states");
        assert_eq!(
            states,
            [
                "running",
                "blocked",
                "blocked",
                "retrying",
                "blocked",
                "succeeded",
                "available"
            ]
        );
        for group in ["g", "j"] {
            sqlx::query(
                "INSERT INTO idem_enqueue (plugin, payload, group_key) VALUES ('noop', '{}', $1)",
            )
            .bind(group)
            .execute(&mut conn)
            .await
            .expect("an insert through the view");
        }
        let states: Vec<(String, String)> =
            sqlx::query_as("SELECT group_key, state FROM jobs WHERE id > 7 ORDER BY id")
                .fetch_all(&mut conn)
                .await
                .expect("states");
        assert_eq!(
            states,
            [
                ("g".to_string(), "blocked".to_string()),
                ("j".to_string(), "available".to_string())
            ]
        );
    }

    #[tokio::test]
    async fn checksums_match_the_files() {
        let migrator = SQLITE.migrator().await.expect("migrator");
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../migrations/sqlite");
        let from_dir = Migrator::new(dir)
            .await
            .expect("migrator from the directory");
        let sums = |m: &Migrator| {
            m.iter()
                .map(|m| (m.version, m.description.to_string(), m.checksum.to_vec()))
                .collect::<Vec<_>>()
        };
        assert_eq!(sums(&migrator), sums(&from_dir));
    }
}

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
);

/// The PostgreSQL schema.
pub(crate) const POSTGRES: Embedded = embed!("postgres":
    1 => "0001_init.sql",
    2 => "0002_effect_retention.sql",
    3 => "0003_clock.sql",
    4 => "0004_unknown_outcomes.sql",
    5 => "0005_notify_per_statement.sql",
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

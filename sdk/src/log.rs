//! Logging into the host's structured logs; each line is tagged with the job.
//!
//! ```
//! idem_sdk::info!("sending invoice {}", 42);
//! ```

/// Severity of a log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    /// Very detailed.
    Trace,
    /// Debugging.
    Debug,
    /// Normal operation.
    Info,
    /// Something unexpected, handled.
    Warn,
    /// Something failed.
    Error,
}

/// Writes one log line to the host (`eprintln!` outside WebAssembly, so plugin
/// logic can be unit-tested natively).
///
/// ```
/// idem_sdk::log::write(idem_sdk::log::Level::Info, "hello");
/// ```
pub fn write(level: Level, message: &str) {
    #[cfg(target_arch = "wasm32")]
    {
        use crate::__private::bindings::idem::plugin::log as wit;
        let level = match level {
            Level::Trace => wit::Level::Trace,
            Level::Debug => wit::Level::Debug,
            Level::Info => wit::Level::Info,
            Level::Warn => wit::Level::Warn,
            Level::Error => wit::Level::Error,
        };
        wit::log(level, message);
    }
    #[cfg(not(target_arch = "wasm32"))]
    eprintln!("[{level:?}] {message}");
}

/// Logs at trace level, like `format!`.
#[macro_export]
macro_rules! trace { ($($arg:tt)*) => { $crate::log::write($crate::log::Level::Trace, &::std::format!($($arg)*)) }; }
/// Logs at debug level, like `format!`.
#[macro_export]
macro_rules! debug { ($($arg:tt)*) => { $crate::log::write($crate::log::Level::Debug, &::std::format!($($arg)*)) }; }
/// Logs at info level, like `format!`.
#[macro_export]
macro_rules! info { ($($arg:tt)*) => { $crate::log::write($crate::log::Level::Info, &::std::format!($($arg)*)) }; }
/// Logs at warn level, like `format!`.
#[macro_export]
macro_rules! warn { ($($arg:tt)*) => { $crate::log::write($crate::log::Level::Warn, &::std::format!($($arg)*)) }; }
/// Logs at error level, like `format!`.
#[macro_export]
macro_rules! error { ($($arg:tt)*) => { $crate::log::write($crate::log::Level::Error, &::std::format!($($arg)*)) }; }

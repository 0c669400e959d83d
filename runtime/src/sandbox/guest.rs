//! Per-job guest state: a deny-by-default WASI context, captured output, the
//! memory limiter and the `log` import.

use super::bindings::idem::plugin::log;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use wasmtime::component::ResourceTable;
use wasmtime::{ResourceLimiter, Result};
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::p2::{OutputStream, Pollable, StreamError};
use wasmtime_wasi::{WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

/// Bytes of stdout/stderr kept per job; the rest is dropped, never trapped on.
pub const OUTPUT_CAPTURE: usize = 16 << 10;
/// Log calls accepted per job; more are counted and dropped.
pub const MAX_LOG_LINES: u32 = 1000;
/// Longest log message kept, in bytes.
pub const MAX_LOG_MESSAGE: usize = 4096;

/// The store data of one job's instance.
pub struct GuestState {
    wasi: WasiCtx,
    table: ResourceTable,
    pub(crate) limiter: MemoryLimiter,
    pub(crate) stdout: CapturedOutput,
    pub(crate) stderr: CapturedOutput,
    job_id: i64,
    plugin: Arc<str>,
    log_lines: u32,
}

impl GuestState {
    /// Fresh state: no preopened dirs, no env, no args, closed stdin, no network.
    pub fn new(job_id: i64, plugin: Arc<str>, memory_cap: usize) -> Self {
        let stdout = CapturedOutput::new(OUTPUT_CAPTURE);
        let stderr = CapturedOutput::new(OUTPUT_CAPTURE);
        let wasi = WasiCtxBuilder::new()
            .stdout(stdout.clone())
            .stderr(stderr.clone())
            .allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false)
            .build();
        GuestState {
            wasi,
            table: ResourceTable::new(),
            limiter: MemoryLimiter::new(memory_cap),
            stdout,
            stderr,
            job_id,
            plugin,
            log_lines: 0,
        }
    }

    /// Sends captured stdout/stderr to `tracing`, tagged with the job.
    pub fn flush_output(&self) {
        for (stream, out) in [("stdout", &self.stdout), ("stderr", &self.stderr)] {
            let text = out.text();
            for line in text.lines().filter(|l| !l.trim().is_empty()) {
                let line = crate::boundary::log_line(line, MAX_LOG_MESSAGE);
                tracing::info!(job_id = self.job_id, plugin = %self.plugin, stream, "{line}");
            }
        }
    }
}

impl WasiView for GuestState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

impl log::Host for GuestState {
    fn log(&mut self, level: log::Level, message: String) {
        self.log_lines += 1;
        if self.log_lines > MAX_LOG_LINES {
            if self.log_lines == MAX_LOG_LINES + 1 {
                tracing::warn!(job_id = self.job_id, plugin = %self.plugin, "log limit reached, dropping further lines");
            }
            return;
        }
        // Checked where it enters: no forged lines, no terminal escapes.
        let message = crate::boundary::log_line(&message, MAX_LOG_MESSAGE);
        let (job_id, plugin) = (self.job_id, &*self.plugin);
        match level {
            log::Level::Trace => tracing::trace!(job_id, plugin, "{message}"),
            log::Level::Debug => tracing::debug!(job_id, plugin, "{message}"),
            log::Level::Info => tracing::info!(job_id, plugin, "{message}"),
            log::Level::Warn => tracing::warn!(job_id, plugin, "{message}"),
            log::Level::Error => tracing::error!(job_id, plugin, "{message}"),
        }
    }
}

/// Raised (as a trap) when a guest asks for more memory than its cap, so an
/// out-of-memory is told apart from a panic.
#[derive(Debug, thiserror::Error)]
#[error("memory cap exceeded: the plugin asked for {desired} bytes, its cap is {cap} bytes")]
pub struct MemoryCapExceeded {
    /// Bytes asked for.
    pub desired: usize,
    /// The cap.
    pub cap: usize,
}

/// Caps linear memory (and tables) per job.
pub struct MemoryLimiter {
    cap: usize,
}

impl MemoryLimiter {
    fn new(cap: usize) -> Self {
        MemoryLimiter { cap }
    }
}

/// Most table elements a guest may grow to.
const MAX_TABLE_ELEMENTS: usize = 100_000;

impl ResourceLimiter for MemoryLimiter {
    fn memory_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _max: Option<usize>,
    ) -> Result<bool> {
        if desired > self.cap {
            return Err(wasmtime::Error::new(MemoryCapExceeded {
                desired,
                cap: self.cap,
            }));
        }
        Ok(true)
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _max: Option<usize>,
    ) -> Result<bool> {
        Ok(desired <= MAX_TABLE_ELEMENTS)
    }
}

/// A bounded in-memory stdout/stderr that drops what does not fit instead of
/// failing the write (which would trap a chatty guest).
#[derive(Clone)]
pub struct CapturedOutput {
    buffer: Arc<Mutex<Vec<u8>>>,
    capacity: usize,
}

impl CapturedOutput {
    fn new(capacity: usize) -> Self {
        CapturedOutput {
            buffer: Arc::new(Mutex::new(Vec::new())),
            capacity,
        }
    }

    fn append(&self, bytes: &[u8]) {
        let mut buffer = self.buffer.lock().expect("output buffer poisoned");
        let room = self.capacity.saturating_sub(buffer.len());
        buffer.extend_from_slice(&bytes[..bytes.len().min(room)]);
    }

    /// What the guest wrote (lossy UTF-8).
    pub fn text(&self) -> String {
        let buffer = self.buffer.lock().expect("output buffer poisoned");
        String::from_utf8_lossy(&buffer).into_owned()
    }
}

impl IsTerminal for CapturedOutput {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for CapturedOutput {
    fn async_stream(&self) -> Box<dyn tokio::io::AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }

    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.clone())
    }
}

impl tokio::io::AsyncWrite for CapturedOutput {
    fn poll_write(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.append(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

#[wasmtime_wasi::async_trait]
impl OutputStream for CapturedOutput {
    fn write(&mut self, bytes: bytes::Bytes) -> Result<(), StreamError> {
        self.append(&bytes);
        Ok(())
    }

    fn flush(&mut self) -> Result<(), StreamError> {
        Ok(())
    }

    fn check_write(&mut self) -> Result<usize, StreamError> {
        Ok(64 << 10)
    }
}

#[wasmtime_wasi::async_trait]
impl Pollable for CapturedOutput {
    async fn ready(&mut self) {}
}

impl super::bindings::idem::plugin::types::Host for GuestState {}

/// The WASI version whose clock functions are replaced.
const MONOTONIC_CLOCK: &str = "wasi:clocks/monotonic-clock@0.2.12";

/// Raised (as a trap) when a plugin tries to wait on a clock: the host would
/// block inside WASI, where epoch deadlines cannot reach, so waiting is refused.
#[derive(Debug, thiserror::Error)]
#[error("the plugin tried to sleep or wait on a clock ({0}); plugins decide, they do not wait")]
pub struct ForbiddenCall(pub &'static str);

/// Replaces `subscribe-duration` and `subscribe-instant` with functions that
/// trap, so `std::thread::sleep` in a plugin ends the call at once instead of
/// blocking a host thread past every deadline.
pub fn forbid_sleeping(linker: &mut wasmtime::component::Linker<GuestState>) -> Result<()> {
    use wasmtime::component::Resource;
    use wasmtime_wasi::p2::DynPollable;
    linker.allow_shadowing(true);
    let mut clock = linker.instance(MONOTONIC_CLOCK)?;
    clock.func_wrap(
        "subscribe-duration",
        |_, (_,): (u64,)| -> Result<(Resource<DynPollable>,)> {
            Err(wasmtime::Error::new(ForbiddenCall("subscribe-duration")))
        },
    )?;
    clock.func_wrap(
        "subscribe-instant",
        |_, (_,): (u64,)| -> Result<(Resource<DynPollable>,)> {
            Err(wasmtime::Error::new(ForbiddenCall("subscribe-instant")))
        },
    )?;
    linker.allow_shadowing(false);
    Ok(())
}

//! Starts real zerolayer deployments as child processes of the `zerolayer` binary: collapsed
//! (one process), split (engine + front over a fresh shared-memory segment) and layered
//! (redis-server on a Unix socket + an engine without reuse + the orchestrator).
//!
//! Used by `zerolayer demo`, `zerolayer bench compare` and the workspace tests. Every process
//! binds port 0 and reports its address on stdout (`zerolayer listening …`); readiness is the
//! `zerolayer ready …` line — nothing here sleeps to wait. Children are killed when their
//! [`Process`] is dropped; their stderr goes to a log file kept for post-mortems.

use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        atomic::{AtomicU64, Ordering},
        mpsc,
    },
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

/// How long a process may take to print its `listening` and `ready` lines (generous: tests
/// run on loaded 2-core machines, and larger models take seconds to generate).
pub const DEFAULT_START_TIMEOUT: Duration = Duration::from_secs(120);

/// Deployment modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// The engine serves gRPC itself.
    Collapsed,
    /// Front + engine over shared memory.
    Split,
    /// Orchestrator + Redis + engine without reuse.
    Layered,
}

impl Mode {
    /// Every mode, in report order.
    pub const ALL: [Mode; 3] = [Mode::Collapsed, Mode::Split, Mode::Layered];

    /// Lower-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Collapsed => "collapsed",
            Mode::Split => "split",
            Mode::Layered => "layered",
        }
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How the servers authenticate.
#[derive(Debug, Clone)]
pub enum Auth {
    /// `--dev-auth`: everyone is tenant `dev`.
    Dev,
    /// A tenants file.
    TenantsFile(PathBuf),
}

/// What every deployment is started with.
#[derive(Debug, Clone)]
pub struct Launcher {
    /// The `zerolayer` binary.
    pub bin: PathBuf,
    /// Model spec.
    pub model: String,
    /// Tokenizer for checkpoints.
    pub tokenizer: Option<PathBuf>,
    /// Authentication.
    pub auth: Auth,
    /// Key directory (`zerolayer keygen`); `None` = ephemeral keys per process.
    pub key_dir: Option<PathBuf>,
    /// Extra `serve` flags for engine processes (e.g. `--kv-blocks 64`).
    pub engine_flags: Vec<String>,
    /// Extra `serve` flags for gRPC-facing processes (front, collapsed, orchestrator).
    pub edge_flags: Vec<String>,
    /// Where logs and sockets go.
    pub work_dir: PathBuf,
    /// Start timeout per process.
    pub start_timeout: Duration,
    /// Serve Prometheus metrics (on a free port).
    pub metrics: bool,
}

impl Launcher {
    /// A launcher with dev auth and ephemeral keys, logging into `work_dir`.
    pub fn new(
        bin: impl Into<PathBuf>,
        model: impl Into<String>,
        work_dir: impl Into<PathBuf>,
    ) -> Self {
        Self {
            bin: bin.into(),
            model: model.into(),
            tokenizer: None,
            auth: Auth::Dev,
            key_dir: None,
            engine_flags: Vec::new(),
            edge_flags: Vec::new(),
            work_dir: work_dir.into(),
            start_timeout: DEFAULT_START_TIMEOUT,
            metrics: true,
        }
    }

    fn common(&self, cmd: &mut Command) {
        cmd.arg("--grpc-addr").arg("127.0.0.1:0");
        cmd.arg("--metrics-addr")
            .arg(if self.metrics { "127.0.0.1:0" } else { "none" });
        match &self.auth {
            Auth::Dev => {
                cmd.arg("--dev-auth");
            }
            Auth::TenantsFile(path) => {
                cmd.arg("--tenants-file").arg(path);
            }
        }
        if let Some(dir) = &self.key_dir {
            cmd.arg("--key-dir").arg(dir);
        }
    }

    fn engine_args(&self, cmd: &mut Command) {
        cmd.arg("--model").arg(&self.model);
        if let Some(t) = &self.tokenizer {
            cmd.arg("--tokenizer").arg(t);
        }
        cmd.args(&self.engine_flags);
    }

    fn serve(&self, mode: &str) -> Command {
        let mut cmd = Command::new(&self.bin);
        cmd.arg("serve").arg("--mode").arg(mode);
        self.common(&mut cmd);
        // Logs stay readable in files; the environment must not leak a developer's settings.
        cmd.env_remove("ZEROLAYER_API_KEYS")
            .env_remove("ZEROLAYER_TENANTS_FILE");
        cmd.env(
            "RUST_LOG",
            std::env::var("ZEROLAYER_CHILD_LOG").unwrap_or_else(|_| "info".into()),
        );
        cmd.env("NO_COLOR", "1");
        cmd
    }

    /// A collapsed deployment.
    pub fn collapsed(&self) -> anyhow::Result<Deployment> {
        let mut cmd = self.serve("collapsed");
        self.engine_args(&mut cmd);
        cmd.args(&self.edge_flags);
        let p = Process::start("collapsed", cmd, self)?;
        Ok(Deployment {
            mode: Mode::Collapsed,
            endpoint: p.endpoint(),
            processes: vec![p],
            shm: None,
        })
    }

    /// A split deployment on a fresh, unique shared-memory segment.
    pub fn split(&self) -> anyhow::Result<Deployment> {
        let shm = unique_name("zl");
        let engine = self.start_engine(&shm)?;
        let front = self.start_front(&shm)?;
        Ok(Deployment {
            mode: Mode::Split,
            endpoint: front.endpoint(),
            processes: vec![engine, front],
            shm: Some(shm),
        })
    }

    /// Starts a split-mode engine on segment `shm`.
    pub fn start_engine(&self, shm: &str) -> anyhow::Result<Process> {
        let mut cmd = self.serve("engine");
        self.engine_args(&mut cmd);
        cmd.arg("--shm").arg(shm);
        Process::start("engine", cmd, self)
    }

    /// Starts a split-mode front on segment `shm`.
    pub fn start_front(&self, shm: &str) -> anyhow::Result<Process> {
        let mut cmd = self.serve("front");
        cmd.arg("--shm").arg(shm);
        cmd.args(&self.edge_flags);
        Process::start("front", cmd, self)
    }

    /// A layered deployment: Redis (Unix socket) + engine without reuse + orchestrator.
    pub fn layered(&self) -> anyhow::Result<Deployment> {
        let redis = Redis::start(&self.work_dir, self.start_timeout)?;
        let mut engine_cmd = self.serve("collapsed");
        self.engine_args(&mut engine_cmd);
        engine_cmd.arg("--no-reuse");
        let engine = Process::start("layered-engine", engine_cmd, self)?;
        let mut cmd = self.serve("orchestrator");
        cmd.arg("--redis-url").arg(redis.url());
        cmd.arg("--engine-url").arg(engine.endpoint());
        cmd.args(&self.edge_flags);
        let orchestrator = Process::start("orchestrator", cmd, self)?;
        Ok(Deployment {
            mode: Mode::Layered,
            endpoint: orchestrator.endpoint(),
            processes: vec![redis.process, engine, orchestrator],
            shm: None,
        })
    }

    /// A deployment of `mode`.
    pub fn start(&self, mode: Mode) -> anyhow::Result<Deployment> {
        match mode {
            Mode::Collapsed => self.collapsed(),
            Mode::Split => self.split(),
            Mode::Layered => self.layered(),
        }
    }
}

/// A unique name for files and segments of this process: prefix, pid, counter, time.
pub fn unique_name(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("{prefix}-{}-{n}-{t:08x}", std::process::id())
}

/// A running deployment. Dropping it kills its processes and removes its segment file.
#[derive(Debug)]
pub struct Deployment {
    /// Its mode.
    pub mode: Mode,
    /// The gRPC URL clients use.
    pub endpoint: String,
    /// Its processes (killed on drop), in start order.
    pub processes: Vec<Process>,
    /// The shared-memory segment (split mode).
    pub shm: Option<String>,
}

impl Drop for Deployment {
    fn drop(&mut self) {
        // Kill in reverse start order (front before engine), then clean the segment a
        // killed engine could not unlink.
        while let Some(p) = self.processes.pop() {
            drop(p);
        }
        if let Some(shm) = &self.shm {
            let _ = std::fs::remove_file(Path::new("/dev/shm").join(shm));
        }
    }
}

impl Deployment {
    /// The process named `name`.
    pub fn process(&self, name: &str) -> Option<&Process> {
        self.processes.iter().find(|p| p.name == name)
    }

    /// The process named `name`, mutably.
    pub fn process_mut(&mut self, name: &str) -> Option<&mut Process> {
        self.processes.iter_mut().find(|p| p.name == name)
    }
}

/// A child process with its announced addresses.
#[derive(Debug)]
pub struct Process {
    /// Role name (`engine`, `front`, `collapsed`, `orchestrator`, `redis`, …).
    pub name: String,
    child: Child,
    /// gRPC address from the `listening` line.
    pub grpc_addr: Option<String>,
    /// Metrics address from the `listening` line.
    pub metrics_addr: Option<String>,
    /// The stderr log file.
    pub log: PathBuf,
    lines: Option<mpsc::Receiver<String>>,
}

impl Process {
    /// Spawns `cmd` and waits for its `listening` and `ready` lines.
    pub fn start(name: &str, mut cmd: Command, launcher: &Launcher) -> anyhow::Result<Self> {
        std::fs::create_dir_all(&launcher.work_dir)?;
        let log = launcher.work_dir.join(format!("{}.log", unique_name(name)));
        let stderr = std::fs::File::create(&log)?;
        cmd.stdout(Stdio::piped())
            .stderr(stderr)
            .stdin(Stdio::null());
        let mut child = cmd
            .spawn()
            .with_context(|| format!("cannot start {name} ({:?})", cmd.get_program()))?;
        let stdout = child.stdout.take().context("child stdout")?;
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut p = Self {
            name: name.to_owned(),
            child,
            grpc_addr: None,
            metrics_addr: None,
            log,
            lines: Some(rx),
        };
        let listening = p.wait_line("zerolayer listening", launcher.start_timeout)?;
        for word in listening.split_whitespace() {
            if let Some(a) = word.strip_prefix("grpc=") {
                p.grpc_addr = Some(a.to_owned());
            }
            if let Some(a) = word.strip_prefix("metrics=") {
                p.metrics_addr = (a != "none").then(|| a.to_owned());
            }
        }
        p.wait_line("zerolayer ready", launcher.start_timeout)?;
        Ok(p)
    }

    /// Waits for a stdout line starting with `prefix`.
    pub fn wait_line(&mut self, prefix: &str, timeout: Duration) -> anyhow::Result<String> {
        let deadline = Instant::now() + timeout;
        let rx = self.lines.as_ref().context("stdout already consumed")?;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) if line.starts_with(prefix) => return Ok(line),
                Ok(_) => continue,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    bail!(
                        "{} did not print {prefix:?} within {timeout:?}; log:\n{}",
                        self.name,
                        self.log_tail()
                    )
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let status = self.child.wait().ok();
                    bail!(
                        "{} exited ({status:?}) before printing {prefix:?}; log:\n{}",
                        self.name,
                        self.log_tail()
                    )
                }
            }
        }
    }

    /// `http://<grpc addr>`.
    pub fn endpoint(&self) -> String {
        format!(
            "http://{}",
            self.grpc_addr.as_deref().unwrap_or("127.0.0.1:0")
        )
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The last 40 lines of the log (for failure messages).
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// `kill -9`.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends SIGTERM (graceful shutdown) without waiting.
    pub fn terminate(&self) -> anyhow::Result<()> {
        let pid = rustix::process::Pid::from_raw(self.child.id() as i32).context("pid")?;
        rustix::process::kill_process(pid, rustix::process::Signal::TERM)?;
        Ok(())
    }

    /// Waits for exit up to `timeout`; `None` if still running.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// CPU seconds (user + system) and peak resident memory in bytes, from /proc.
    pub fn resources(&self) -> Option<Resources> {
        resources(self.child.id())
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

/// CPU and memory of a process.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Resources {
    /// User + system CPU seconds.
    pub cpu_seconds: f64,
    /// Peak resident set size (VmHWM), bytes.
    pub peak_rss_bytes: u64,
}

/// Reads /proc/<pid>/stat and /proc/<pid>/status.
pub fn resources(pid: u32) -> Option<Resources> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the `(comm)`: state is field 3; utime and stime are fields 14 and 15.
    let after = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = rustix::param::clock_ticks_per_second() as f64;
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let hwm_kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    Some(Resources {
        cpu_seconds: (utime + stime) / ticks,
        peak_rss_bytes: hwm_kb * 1024,
    })
}

/// A redis-server child on a Unix socket in a private directory.
#[derive(Debug)]
pub struct Redis {
    /// The process.
    pub process: Process,
    socket: PathBuf,
}

impl Redis {
    /// Starts `redis-server` (from PATH) without persistence, listening only on a socket.
    pub fn start(work_dir: &Path, timeout: Duration) -> anyhow::Result<Self> {
        let dir = work_dir.join(unique_name("redis"));
        std::fs::create_dir_all(&dir)?;
        let socket = dir.join("redis.sock");
        let mut cmd = Command::new("redis-server");
        cmd.args([
            "--port",
            "0",
            "--save",
            "",
            "--appendonly",
            "no",
            "--unixsocketperm",
            "700",
        ])
        .arg("--unixsocket")
        .arg(&socket)
        .arg("--dir")
        .arg(&dir);
        let log = dir.join("redis.log");
        cmd.stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log)?)
            .stdin(Stdio::null());
        let mut child = cmd
            .spawn()
            .context("cannot start redis-server (install it: apt-get install redis-server)")?;
        let stdout = child.stdout.take().context("redis stdout")?;
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut process = Process {
            name: "redis".into(),
            child,
            grpc_addr: None,
            metrics_addr: None,
            log,
            lines: Some(rx),
        };
        // Redis 6 prints "Ready to accept connections", Redis 7 "… ready to accept
        // connections at <socket>".
        process.wait_line_containing("eady to accept connections", timeout)?;
        Ok(Self { process, socket })
    }

    /// `redis+unix://` URL of the socket.
    pub fn url(&self) -> String {
        format!("redis+unix://{}", self.socket.display())
    }
}

impl Process {
    fn wait_line_containing(&mut self, needle: &str, timeout: Duration) -> anyhow::Result<String> {
        let deadline = Instant::now() + timeout;
        let rx = self.lines.as_ref().context("stdout already consumed")?;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) if line.contains(needle) => return Ok(line),
                Ok(_) => continue,
                Err(_) => bail!(
                    "{} did not print {needle:?}; log:\n{}",
                    self.name,
                    self.log_tail()
                ),
            }
        }
    }
}

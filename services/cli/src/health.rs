//! `zerolayer health --addr URL`: exits 0 when the server reports SERVING (container health
//! checks need no shell or grpcurl in the image).

use std::time::Duration;

/// Arguments of `zerolayer health`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Server URL.
    #[arg(
        long,
        env = "ZEROLAYER_HEALTH_ADDR",
        default_value = "http://127.0.0.1:50051"
    )]
    pub addr: String,
    /// Seconds to wait for an answer.
    #[arg(long, default_value_t = 3)]
    pub timeout_s: u64,
}

/// Runs `zerolayer health`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let client = zerolayer_client::Client::new(
            zerolayer_client::ClientConfig::new(args.addr.clone())
                .retry(zerolayer_client::RetryPolicy::none()),
        )?;
        match tokio::time::timeout(Duration::from_secs(args.timeout_s), client.health()).await {
            Ok(Ok(true)) => {
                println!("SERVING");
                Ok(())
            }
            Ok(Ok(false)) => anyhow::bail!("NOT_SERVING"),
            Ok(Err(e)) => anyhow::bail!("health check failed: {e}"),
            Err(_) => anyhow::bail!("no answer within {}s", args.timeout_s),
        }
    })
}

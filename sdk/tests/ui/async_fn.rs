#[idem_sdk::plugin]
async fn handle(_job: idem_sdk::Job<()>) -> Result<Vec<idem_sdk::Effect>, idem_sdk::JobError> {
    Ok(Vec::new())
}

fn main() {}

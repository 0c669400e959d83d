#[idem_sdk::plugin]
fn handle(_job: idem_sdk::Job<()>, _extra: u32) -> Result<Vec<idem_sdk::Effect>, idem_sdk::JobError> {
    Ok(Vec::new())
}

fn main() {}

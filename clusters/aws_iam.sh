#!/usr/bin/env bash
# One-time AWS setup for clusters/*.yaml: the instance profile every node of a yatt_ray cluster runs with.
#
#   bash clusters/aws_iam.sh            # idempotent: creates what is missing, changes nothing that exists
#
# Every node (head and GPU workers) gets the profile `yatt-ray-node`, so that each process of a run (the
# driver, the trainers, Ray Data's read tasks, the checkpoint writers) finds S3 credentials the standard way
# (the instance metadata service), with no key in a config. Its role may:
# - read and write S3 (AmazonS3FullAccess; narrow it to your buckets if you like),
# - launch and stop EC2 instances (AmazonEC2FullAccess: the head's autoscaler starts the workers),
# - pass itself to the workers it launches (iam:PassRole on this role only): without it the head cannot start
#   a worker that carries the profile.
# Needs the AWS CLI and credentials allowed to create IAM roles (an account admin, once per account).
set -euo pipefail
NAME="${YATT_RAY_IAM_NAME:-yatt-ray-node}"

if ! aws iam get-role --role-name "$NAME" > /dev/null 2>&1; then
  aws iam create-role --role-name "$NAME" --description "yatt_ray cluster nodes" \
    --assume-role-policy-document '{"Version": "2012-10-17", "Statement": [{"Effect": "Allow",
      "Principal": {"Service": "ec2.amazonaws.com"}, "Action": "sts:AssumeRole"}]}' > /dev/null
  echo "created role $NAME"
fi
for policy in AmazonS3FullAccess AmazonEC2FullAccess; do
  aws iam attach-role-policy --role-name "$NAME" --policy-arn "arn:aws:iam::aws:policy/$policy"
done
ROLE_ARN=$(aws iam get-role --role-name "$NAME" --query Role.Arn --output text)
aws iam put-role-policy --role-name "$NAME" --policy-name pass-itself --policy-document \
  "{\"Version\": \"2012-10-17\", \"Statement\": [{\"Effect\": \"Allow\", \"Action\": \"iam:PassRole\",
    \"Resource\": \"$ROLE_ARN\"}]}"

if ! aws iam get-instance-profile --instance-profile-name "$NAME" > /dev/null 2>&1; then
  aws iam create-instance-profile --instance-profile-name "$NAME" > /dev/null
  aws iam add-role-to-instance-profile --instance-profile-name "$NAME" --role-name "$NAME"
  echo "created instance profile $NAME (IAM takes ~15 s to make it usable)"
fi
echo "instance profile $NAME: ready"
